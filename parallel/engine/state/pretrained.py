"""save_pretrained's two ways to the Hugging Face files (engine.checkpoints.save_pretrained picks):
`gathered`, each rank's pieces of the model written in place in their files (hf_gather.py), and
`staged`, through a checkpoint of the model written beside the output and read back (a PEFT run's
adapter, and process groups that cannot carry the pieces)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from parallel.checkpoint.format.directory import begin_checkpoint
from parallel.checkpoint.hf.export import hf_config_json, peft_config_json
from parallel.checkpoint.background.sink import Sink


def hf_config(model) -> dict:
    cfg = hf_config_json(model)
    if cfg is None:
        raise ValueError("save_pretrained / checkpoint.hf_at_end: the model has no Hugging Face "
                         "config (not a transformers model); use save()")
    return json.loads(cfg)


def gathered(engine, write, out: Path, max_shard_bytes: int | None, durable: bool, device) -> None:
    """`write(sink)`: the backend's portable save, here of the model section into a Capture (DCP
    plans it; no file is written), whose pieces write_gathered writes in place."""
    from parallel.checkpoint.hf.hf_files import weight_dtype
    from parallel.checkpoint.hf.hf_gather import Capture, write_gathered

    cfg, dtype = hf_config(engine.model), weight_dtype(engine.spec.precision)
    engine.check_finite(wait=True)
    capture = Capture()
    write(Sink(out, sections=("model",), capture=capture))
    write_gathered(capture, cfg, dtype, out, max_shard_bytes, engine.rank, engine.world_size,
                   device, durable)


def staged(engine, write, save, out: Path, max_shard_bytes: int | None, durable: bool) -> None:
    """Every rank writes its shards of the model alone (no optimizer state, no fsync: a staging
    copy whose pages need never reach the disk) beside `out`, then its share of the safetensors
    files from them (write_hf's `part`); a PEFT run's main rank writes the adapter from a whole
    staged checkpoint (`save`: the engine's own, without `latest`). The staging directory,
    polyshard's own, is removed."""
    from parallel.checkpoint.hf.export import export_peft, plain_weights, write_hf

    staging = out.parent / f".{out.name}.polyshard-state"
    peft = peft_config_json(engine.model) is not None
    if peft:
        save(staging, async_save=False, pointer=False)
        state = staging
    else:
        cfg = hf_config(engine.model)
        engine.check_finite(wait=True)
        state = begin_checkpoint(staging, engine.rank)
        write(Sink(state, sections=("model",), durable=False))
        engine.barrier()  # every rank's state files are in place before any is read
    try:
        if not peft:  # the model's shards alone: its config and dtype are the engine's
            write_hf(plain_weights(state, cfg), cfg, engine.spec.precision, out, max_shard_bytes,
                     (engine.rank, engine.world_size), durable)
        elif engine.is_main:
            export_peft(state, out)
        engine.barrier()
    finally:
        if engine.is_main:
            shutil.rmtree(state, ignore_errors=True)
