"""Configs people already have. Kits, which backends import: importing.py (the spec being built from
a file, and the report), exporting.py (the vocabulary every export shares) and distributed_config.py
(transformers' DistributedConfig in). Dispatchers, which pick the backend through the registry:
accelerate.py (accelerate files and ParallelismConfig objects in) and export.py (every export)."""
