"""Checkpoints, grouped by concern:

- format/: what a checkpoint directory is: atomic directories published by `latest` (directory.py),
  what a complete one is and its verification (manifest.py), files read as data (safe.py), the one
  reader of a checkpoint's small files (contents.py) and their schemas (schemas.py), DCP's items
  unpickled once per distinct pickle, as data (tensor_items.py), a tokenizer copied as data
  (tokenizer.py).
- state/: the portable state every backend reads and writes (portable.py, the optimizer's by name in
  optim_state.py; its files written, hashed and sent to the disk by state_files.py), a rank's ranges
  of a tensor as blocks of the whole (chunks.py), each save's sink, through which every file of it
  passes (sink.py), the adapter for modules torch's get_state_dict understands (dcp_state.py), and a
  state written by several writers from one process, one part in memory at a time (streamed.py).
- background/: a save's last steps, hashes, manifest, rename and `latest` (finishing.py), and saving
  in the background when asked (saver.py: the saver; staging.py: the host copies; writer.py: the
  writer process).
- hf/: the Hugging Face export (export.py: what is exported; hf_files.py: the safetensors files it
  writes; hf_gather.py: save_pretrained's pieces written in place by every rank).
Layered: importers.py and hf/ over background/ over state/ over format/, none importing one above it
(tests/unit/test_architecture.py).
- importers.py: native checkpoints (DCP, DeepSpeed, XLA, Accelerate) brought into the format."""
