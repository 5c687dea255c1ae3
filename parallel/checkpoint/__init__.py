"""Checkpoints: atomic directories with a manifest (directory.py), the portable state every backend
reads and writes (portable.py), its DCP adapter for modules torch's get_state_dict understands
(dcp_state.py), native imports and the HF export (importers.py)."""
