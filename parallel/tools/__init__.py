"""Tools built on the Engine: bench/, parity/, plan.py."""
