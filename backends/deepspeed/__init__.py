"""DeepSpeed ZeRO 0-3: the spec becomes a DeepSpeed config, then `deepspeed.initialize` drives training.

descriptor.py: everything the rest of polyshard knows about this backend; engine.py: the engine,
composed from runtime/'s steps; plan.py: its memory and communication model; muon.py: where ZeRO's
flat partitions put each matrix's pieces (torch.optim.Muon). By concern:
- config/: the spec as a DeepSpeed config, plain data (no deepspeed import);
- runtime/: what runs with deepspeed imported (set-up steps, the pipeline engine, AutoTP's split,
  just-in-time ops, the import itself);
- checkpoint/: its checkpoint state to and from the portable format, and DeepSpeed's own
  checkpoints in and out;
- files/: DeepSpeed's and accelerate's config files in and out.
"""
