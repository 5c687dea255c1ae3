"""What is done to the model: params.py (parameters by name across sharding, tied weights, optimizer
groups), wrap.py (shard units, activation checkpointing), tp_plan.py (the tensor-parallel plan, checked
against the model), compile.py (torch.compile applied the same way everywhere), tiled_loss.py (a
causal LM's loss a tile of tokens at a time), context_parallel.py (topology.cp: each row's tokens split
over ranks, attention through an all-to-all), moe/ (mixture-of-experts blocks: unused experts, the
router's balancing loss, topology.ep's token dispatch), pipeline/ (topology.pp: stages and their
schedule), optim/ (the optimizers over the model's parameters: several in one job, torch.optim.Muon
on sharded matrices), float8.py (precision: fp8: linears converted to torchao's Float8Linear)."""
