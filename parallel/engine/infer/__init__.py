"""The sharded model used without training it: evaluate.py (token-weighted evaluation over every rank's
samples) and generate.py (Hugging Face generation, ranks in step; static shapes on XLA)."""
