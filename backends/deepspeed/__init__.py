"""DeepSpeed ZeRO 0-3: the spec becomes a DeepSpeed config, then `deepspeed.initialize` drives training.

descriptor.py: everything the rest of polyshard knows about this backend; translate.py: the spec as a
DeepSpeed config (plain data, no deepspeed import); engine.py: the engine; state.py: its checkpoint
state; plan.py: memory and communication model; schema.py, interop.py, accelerate.py, exports.py:
DeepSpeed's own rules and its files in and out; native_checkpoint.py: DeepSpeed checkpoints in.
"""
