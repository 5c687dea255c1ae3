"""The Engine every backend implements (base.py) and what it is made of: process group (dist.py),
resumable data (data.py), guards (guards.py), parameters by name (params.py), wrap plans (wrap.py),
save / load (checkpointing.py)."""
