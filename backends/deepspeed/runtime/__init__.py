"""DeepSpeed at run time: parallelize.py (the engine's set-up steps: deepspeed.comm, the model,
AutoTP's plan, `deepspeed.initialize`, its clipping), pipe.py (`topology.pp` through its pipeline
engine), autotp_split.py (what AutoTP did to a model), ops.py (its just-in-time ops: built ahead,
first builds said, a killed build's lock refused), library.py (deepspeed imported without what only
features polyshard never runs import: mlflow, inductor's compiler)."""
