"""Where a save's bytes go: sink.py (each save's sink: every file of a save passes through it),
saver.py (the background saver: one write in flight), staging.py (the host copies of an async
save), writer.py (the writer process that writes and publishes them)."""
