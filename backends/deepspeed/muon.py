"""Where each rank's elements of a Muon matrix sit in DeepSpeed's flat fp32 partitions (torch.optim.
Muon's layouts: parallel/engine/model/optim/muon.py). DeepSpeed hands the client optimizer one flat
partition per group (ZeRO-1/2) or per sub-group (ZeRO-3), each holding pieces of many matrices:

- ZeRO-1/2: a group's parameters are laid flat at `round_robin_bit16_offsets` (alignment padding
  between them) and the flat buffer is cut into `partition_size` runs, rank r the r-th;
- ZeRO-3: each parameter is cut on its own into `partition_numel()` runs (its last padded), and a
  sub-group's flat partition is its parameters' runs of this rank, one after another.

Both are read off the live optimizer after `deepspeed.initialize`, the same on every rank.

DeepSpeed's own MuonWithAuxAdam is not used: it computes another update than torch.optim.Muon (its
Newton-Schulz divides by the norm + 1e-7 where torch clamps the norm at eps, and runs a 'gram'
kernel by default), so the job would not be the one process's torch.optim.Muon."""

from __future__ import annotations

from parallel.engine.model.optim.layouts import flat_run
from parallel.engine.model.optim.muon import Layout, MuonRefused


def zero_layouts(zero, muon_groups: set[int], param_groups: list[dict]) -> dict[int, list[Layout]]:
    """id(flat fp32 partition) -> the Layouts of the matrices it holds pieces of, for the groups
    whose dicts are in `muon_groups` (ids); `param_groups`: the client optimizer's, in order."""
    import torch.distributed as dist

    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        out = {}
        group = zero.dp_process_group
        size, me = dist.get_world_size(group), dist.get_rank(group)
        for s, flat in enumerate(zero.fp32_partitioned_groups_flat):
            if id(param_groups[zero.sub_group_to_group_id[s]]) in muon_groups:
                out[id(flat)] = _zero3_sub_group(zero.fp16_groups[s], group, size, me)
        return out
    if not hasattr(zero, "round_robin_bit16_offsets"):
        raise MuonRefused(f"optimizer: torch.optim.Muon under DeepSpeed's {type(zero).__name__} "
                          "(ZeRO-0 in bf16/fp16): its flat groups' layout is not read here; use "
                          "ZeRO-1, 2 or 3, or precision fp32 at ZeRO-0")
    out = {}
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        if id(param_groups[i]) not in muon_groups:
            continue
        group = zero.real_dp_process_group[i]
        size, me = dist.get_world_size(group), dist.get_rank(group)
        cut = int(zero.partition_size[i])
        layouts = []
        for meta, offset in zip(zero.round_robin_bit16_meta[i], zero.round_robin_bit16_offsets[i]):
            pieces = [flat_run(offset, meta.numel(), r * cut, (r + 1) * cut) for r in range(size)]
            local = max(offset, me * cut) - me * cut
            layouts.append(Layout(tuple(meta.shape), group, pieces, me,
                                  slice(local, local + pieces[me].numel)))
        out[id(flat)] = layouts
    return out


def _zero3_sub_group(params, group, size: int, me: int) -> list[Layout]:
    layouts, at = [], 0
    for p in params:
        numel, cut = p.ds_numel, p.partition_numel()
        pieces = [flat_run(0, numel, r * cut, (r + 1) * cut) for r in range(size)]
        layouts.append(Layout(tuple(p.ds_shape), group, pieces, me,
                              slice(at, at + pieces[me].numel)))
        at += cut
    return layouts
