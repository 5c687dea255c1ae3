"""Configs people already have. Kits, which backends import: importing.py (the spec being built from
a file, and the report) and exporting.py (the vocabulary every export shares). Dispatchers, which pick
the backend through the registry: accelerate.py (accelerate files in), objects.py (accelerate's ParallelismConfig and
transformers' DistributedConfig, as held in Python or written as JSON) and export.py (every export)."""
