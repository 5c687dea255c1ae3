"""The batch side of the engine: loaders.py (the engine's data loaders, by name, their position saved),
resumable.py (the sampler and loader whose position survives a checkpoint), guard.py (a malformed batch
fails its rank before any collective), batches.py (micro-batches, moving to the device, token counts),
packing.py (documents packed into full rows, attention and targets confined to each), documents.py
(one document's ids and labels, checked against the vocabulary)."""
