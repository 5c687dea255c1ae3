"""The spec as DeepSpeed reads it, plain data (`polyshard validate` and `explain` import no deepspeed):
translate.py (the config a spec means; its SpecErrors are the backend's rules), options.py (the
`deepspeed:` section), schema.py (what DeepSpeed 0.19.8 reads from a config), autotp.py
(`topology.tp` as AutoTP's plan), pipe_config.py (`topology.pp`: what DeepSpeed's pipeline engine
runs, refuses and why)."""
