"""A save's writing after the state is handed over: finishing.py (hashes, fsync, manifest, rename,
`latest`: the same steps for a synchronous save and the writer), saver.py (the background saver: one
write in flight), staging.py (the host copies of an async save), writer.py (the writer process that
writes and publishes them)."""
