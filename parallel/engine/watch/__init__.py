"""Parts the engine owns that watch the run, each one object testable alone: hang.py (which ranks are
elsewhere when a collective times out), stall.py (a call into torch.distributed that one rank
entered alone, named while it waits), flight.py (torch's Flight Recorder: the collective each rank
reached, for hang.py's report), preempt.py (a signal becomes an agreed save and a requeue
exit), nonfinite.py (a non-finite loss, found without a host read), compile.py (did torch.compile run
compiled)."""
