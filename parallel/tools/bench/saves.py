"""`polyshard bench --save`, in a cell's processes after its timed steps: how long polyshard's save
and load take against the backend's own checkpointing, the GB/s against the disk's (disk.py), the
Hugging Face weights (save_pretrained, what checkpoint.hf_at_end writes) against a DCP save of the
same weights, and what an async save costs the steps that run while it writes."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch.distributed as dist


def save_cell(engine, root: Path, batches: list) -> dict:
    """Every figure of --save, in one dict (bench.json's `saves`, report.save_text's line)."""
    return {**save_times(engine, root), **hf_times(engine, root),
            **async_step_cost(engine, batches, root)}


def save_times(engine, root: Path) -> dict:
    """Seconds `save` blocks the training loop (synchronous, and with checkpoint.async_save), and
    seconds `load` takes, verification included; beside them the backend's own checkpointing as its
    docs write it (engine.native_checkpoint: DCP of get_state_dict, DeepSpeed's save_checkpoint) on
    the same state in the same processes, alternating with polyshard's. Loads are cold (the files'
    cached pages dropped first). Medians of five after one untimed round of each; each checkpoint
    is removed once timed. Rank 0 adds the checkpoint's bytes, GB/s, and the disk's own direct
    write and cold read beside it (bench/disk.py)."""
    native, timed = engine.native_checkpoint(), _timer(engine, wait=True)

    def drop(path: Path) -> None:
        dist.barrier()  # every rank is done with the files before one rank removes them
        if engine.is_main:
            shutil.rmtree(path, ignore_errors=True)

    from parallel.heap import paused_gc
    from parallel.tools.bench.disk import evict, tree_bytes

    rounds: dict[str, list[float]] = {}
    for i in range(6):  # round 0 warms DCP's plans and caches, and async save's process group
        ours, theirs = root / f"ours-{i}", root / f"native-{i}"
        times = {"sync_s": timed(lambda: engine.save(ours, async_save=False))}
        evict(ours)  # a cold load, as after a restart: from the disk, not the page cache
        times["load_s"] = timed(lambda: engine.load(ours))
        if i == 0 and engine.is_main:  # the checkpoint's bytes, every rank's files
            size = tree_bytes(ours)
        if native:  # with the collector paused as polyshard's save and load pause it (torchtitan
            with paused_gc():  # runs with it off): a collection landing inside would time Python
                times["native_save_s"] = timed(lambda: native[0](theirs))
                evict(theirs)
                times["native_load_s"] = timed(lambda: native[1](theirs))
        drop(ours)
        drop(theirs)
        if engine.background_save:
            start = time.perf_counter()
            engine.save(root / f"async-{i}", async_save=True)
            times["async_blocking_s"] = time.perf_counter() - start
            times["async_total_s"] = timed(lambda: None) + times["async_blocking_s"]
            drop(root / f"async-{i}")
        for key, value in times.items():
            rounds.setdefault(key, []).append(value)
    out = {key: statistics.median(values[1:]) for key, values in rounds.items()}
    if engine.is_main:  # GB/s against the disk's own, measured beside the checkpoint
        from parallel.tools.bench.disk import rates

        out.update(rates(size, out["sync_s"], out["load_s"], root))
    if native:
        out["save_vs_native"] = out["sync_s"] / out["native_save_s"]
        out["load_vs_native"] = out["load_s"] / out["native_load_s"]
    return out


def _timer(engine, wait: bool = False):
    """timed(action): seconds from a barrier to a barrier after it; `wait`: until an async save
    it started is published."""
    def timed(action) -> float:
        dist.barrier()
        start = time.perf_counter()
        action()
        if wait:
            engine.wait_for_save()
        dist.barrier()
        return time.perf_counter() - start
    return timed


def hf_times(engine, root: Path) -> dict:
    """`save_pretrained` (durable: what checkpoint.hf_at_end writes) against a DCP save of the
    same weights alone (every rank its shards, fsynced: DCP's own writer), medians of five after
    an untimed round; rank 0 adds the safetensors' bytes and GB/s. {} for a model without a
    Hugging Face config."""
    from parallel.checkpoint.hf.export import hf_config_json
    from parallel.checkpoint.state.sink import Sink
    from parallel.tools.bench.disk import tree_bytes

    if hf_config_json(engine.model) is None:
        return {}
    timed, ckpt = _timer(engine), engine.checkpoints
    rounds: dict[str, list[float]] = {"hf_s": [], "weights_dcp_s": []}
    for i in range(6):
        hf, weights = root / f"hf-{i}", root / f"weights-{i}"
        rounds["hf_s"].append(timed(lambda: ckpt.save_pretrained(hf, durable=True)))
        rounds["weights_dcp_s"].append(timed(lambda: ckpt.write(Sink(weights, sections=("model",)))))
        size = tree_bytes(hf) if engine.is_main else 0
        dist.barrier()
        if engine.is_main:
            shutil.rmtree(hf, ignore_errors=True)
            shutil.rmtree(weights, ignore_errors=True)
    out = {k: statistics.median(v[1:]) for k, v in rounds.items()}
    out["hf_vs_dcp"] = out["hf_s"] / out["weights_dcp_s"]
    if engine.is_main:
        out.update(hf_bytes=size, hf_gbps=size / out["hf_s"] / 1e9)
    return out


def async_step_cost(engine, batches: list, root: Path) -> dict:
    """What an async save costs the steps that run while it writes: the mean time of the timed
    batches' steps right after `save(async_save=True)` returned (the write in flight; waited for
    after the last) against the same steps with no save, alternated over three rounds; what the
    save blocked; and how long the write still ran after those steps (whether it kept pace).
    {} where the backend cannot save in the background."""
    if not engine.background_save or not batches:
        return {}
    timed, saver = _timer(engine), engine.checkpoints.saver
    plain, during, blocked, left = [], [], [], []
    for i in range(4):  # round 0 warms the background saver's group and buffers
        plain.append(sum(timed(lambda b=b: engine.train_step(b)) for b in batches) / len(batches))
        blocked.append(timed(lambda: engine.save(root / f"inflight-{i}", async_save=True)))
        waited = saver.staging_wait_s
        during.append(sum(timed(lambda b=b: engine.train_step(b)) for b in batches) / len(batches))
        # blocked: save's return, and what the next update waited for its copies (Checkpointer.staged)
        blocked[-1] += saver.staging_wait_s - waited
        left.append(timed(engine.wait_for_save))  # the write had not kept pace by this much
        dist.barrier()
        if engine.is_main:
            shutil.rmtree(root / f"inflight-{i}", ignore_errors=True)
    plain_s, during_s = statistics.median(plain[1:]), statistics.median(during[1:])
    return {"inflight_step_s": during_s, "plain_step_s": plain_s,
            "inflight_slowdown": during_s / plain_s - 1, "async_block_s": statistics.median(blocked[1:]),
            "inflight_write_left_s": statistics.median(left[1:])}
