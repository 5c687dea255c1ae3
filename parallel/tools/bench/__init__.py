"""`polyshard bench`: report.py (cells, and every figure), table.py (the table), cell.py (one cell,
per rank), measure.py (collective bytes, held bytes), counting.py (what a step pays: collectives, host
reads, store calls), profile.py (where a step's time goes), startup.py (start-up to the first step,
with jobs/startup.py the job it times), sweep.py (--seq over several lengths: the longest within a
budget, with and without cp), saves.py (--save's timings), disk.py (--save's disk probe: direct
write, cold read), plot.py."""
