"""DeepSpeed's and accelerate's files in and out: interop.py (a DeepSpeed JSON as a spec, meaning what
DeepSpeed meant; import_zero.py: its zero_optimization block, import_tp.py: its AutoTP block),
accelerate.py (an accelerate YAML's deepspeed_config), exports.py (specs as accelerate, HF Trainer
and DeepSpeed files)."""
