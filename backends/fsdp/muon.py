"""Where each rank's elements of an FSDP1 parameter sit (torch.optim.Muon's layouts: parallel/engine/
optim/muon.py). With use_orig_params each original parameter is a 1-D view of its unit's flat shard:
a run of the parameter's flattened elements. The flat parameter is laid out as FSDP1 lays it out
(`_numels_with_padding`, alignment padding included) and cut as `FlatParamHandle._get_unpadded_shard`
cuts it (torch.chunk over the shard group's ranks), so every rank's run is known on every rank."""

from __future__ import annotations

import math

from parallel.engine.model.optim.layouts import flat_run
from parallel.engine.model.optim.muon import Layout, MuonRefused


def flat_layouts(model) -> dict[int, Layout]:
    """id(original parameter) -> its Layout, for every unit's parameters (use_orig_params)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = {}
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None or handle.flat_param._params is None:
            continue
        flat = handle.flat_param
        size = handle.world_size
        total = sum(flat._numels_with_padding)
        chunk = math.ceil(total / size)
        offsets, at = [], 0
        for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not padding:
                offsets.append(at)
            at += numel
        for p, offset, shape in zip(flat._params, offsets, flat._shapes):
            if len(shape) != 2:
                continue
            numel = shape[0] * shape[1]
            pieces = [flat_run(offset, numel, r * chunk, min((r + 1) * chunk, total))
                      for r in range(size)]
            out[id(p)] = Layout((shape[0], shape[1]), handle.process_group, pieces, handle.rank)
    return out


def layout_of(layouts: dict[int, Layout], p, name: str, shape: tuple) -> Layout | None:
    """FSDP1's answer to `_matrix_layout`: the flat run where sharded, whole where not."""
    layout = layouts.get(id(p))
    if layout is not None:
        if layout.pieces[layout.me].numel != p.numel():
            raise MuonRefused(f"optimizer: torch.optim.Muon over {name}: FSDP1 holds "
                              f"{p.numel()} of its elements here, its layout says "
                              f"{layout.pieces[layout.me].numel}")
        return layout if len(layout.pieces) > 1 else None
    if tuple(p.shape) == tuple(shape):
        return None
    raise MuonRefused(f"optimizer: torch.optim.Muon over {name}: FSDP1 holds it as a "
                      f"{tuple(p.shape)} tensor in no unit this engine knows")
