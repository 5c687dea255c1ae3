"""Tools built on the Engine: bench/ (`polyshard bench`), parity/ (`polyshard parity`), plan.py
(`polyshard plan`, its communication in comm.py, its activation model in activations.py,
topology.pp's bubble, stages and sends in stages.py, topology.ep's experts and all-to-alls in
experts.py, the model as both see it in facts.py; per-layout sizes: parallel/kits/sizes.py),
dryrun.py (`polyshard dryrun`), cells.py (a backend or variant name as a spec)."""
