"""torch FSDP: FSDP2 (`fully_shard`, default) and FSDP1 (`FullyShardedDataParallel`).

descriptor.py: everything the rest of polyshard knows about this backend; options.py: its section of
the spec (`fsdp:`); translate.py: the spec as FSDP's arguments (plain data); engine.py: the engines,
composed from parallelize.py's apply_* steps; layout.py: the shard units at the model's edges;
flat_state.py: FSDP1's sharded checkpoints, its flat shards' ranges written and read in place;
plan.py: memory and communication model; muon.py: where FSDP1's flat shards put each matrix's
pieces (torch.optim.Muon); exports.py / accelerate.py: accelerate and HF Trainer files out and in.
"""
