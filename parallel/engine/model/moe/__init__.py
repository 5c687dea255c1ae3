"""Mixture-of-experts blocks as Hugging Face writes them (an `experts` list behind a router): experts.py
(experts a step does not use, skipped as one process skips them), router.py (the router's
load-balancing loss over the global batch), expert_parallel.py (topology.ep: a block's experts split
over ranks, tokens dispatched to them by all-to-all)."""
