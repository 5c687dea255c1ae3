"""PyTorch/XLA FSDP: `xla.fsdp_version: 1` (XlaFullyShardedDataParallel, one process per device) and
`2` (SPMD SpmdFullyShardedDataParallel, one process per host over a device mesh).

descriptor.py: everything the rest of polyshard knows about this backend; options.py: its section of
the spec (`xla:`); translate.py: the spec as XLA's arguments (plain data); engine.py picks common.py's
v1.py or spmd.py; layout.py: v1's shard layout; plan.py, exports.py, accelerate.py,
native_checkpoint.py: plan model, files out and in. torch_xla is imported when an engine is built.
"""
