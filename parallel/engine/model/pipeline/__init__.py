"""topology.pp: a Hugging Face decoder split into pipeline stages under its own names (stages.py), the
stages and the view over them made before sharding (apply.py), and torch.distributed.pipelining's
schedules run so that a step gives one process's loss and gradients (schedule.py)."""
