"""What is done to the model: params.py (parameters by name across sharding, tied weights, optimizer
groups), wrap.py (shard units, activation checkpointing), tp_plan.py (the tensor-parallel plan, checked
against the model), compile.py (torch.compile applied the same way everywhere), experts.py (experts a
step does not use), tiled_loss.py (a causal LM's loss a tile of tokens at a time), context_parallel.py
(topology.cp: each row's tokens split over ranks, attention through an all-to-all), router.py (a
mixture-of-experts router's load-balancing loss over the global batch), pipeline/ (topology.pp: stages
and their schedule)."""
