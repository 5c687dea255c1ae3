"""Tools built on the Engine: bench/ (`polyshard bench`), parity/ (`polyshard parity`), plan.py
(`polyshard plan`, its per-layout sizes in sizes.py, its communication in comm.py), dryrun.py
(`polyshard dryrun`), cells.py (a
backend or variant name as a spec), measurable.py (what bench and parity read of an engine)."""
