"""Checkpoints: atomic directories published by `latest` (directory.py), what a complete one is and its
verification (manifest.py), the portable state every backend reads and writes (portable.py, the
optimizer's by name in optim_state.py; its files written, hashed and sent to the disk by
state_files.py) through each save's sink (sink.py), in the background when asked (background.py: the
saver; staging.py: the host copies; writer.py: the writer process), a rank's ranges of a tensor as
blocks of the whole (chunks.py), files read as data (safe.py; DCP's items once per distinct pickle:
tensor_items.py), the one reader of a checkpoint's small files (contents.py) and their schemas
(schemas.py), its DCP adapter for modules torch's get_state_dict understands (dcp_state.py), native
imports (importers.py) and the Hugging Face export (hf.py: what is exported; hf_files.py: the
safetensors files it writes; hf_gather.py: save_pretrained's pieces written in place by every rank)
with a tokenizer copied as data (tokenizer.py); streamed.py: a state written by several writers from
one process, one part in memory at a time (streaming imports)."""
