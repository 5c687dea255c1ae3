"""Kits: small pure helpers below every layer that uses them (the engine, checkpoints, backends,
tools), importing nothing of polyshard above them: names.py (a parameter's portable name, wrappers'
parts taken out), sizes.py (elements a rank holds of parameter shapes under each way of sharding),
measurable.py (what bench and parity read of an engine's state), objective.py (what a step
minimises: each micro-batch's items over the global count), model_limits.py (what a model config may
ask for), problems.py (SpecError, the one error for unusable input), device.py (the device a rank
trains on, through torch's device-generic APIs)."""
