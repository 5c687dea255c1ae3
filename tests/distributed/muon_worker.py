"""torch.optim.Muon on sharded matrices against torch's on the whole ones, from the same gradients:
every layout the backends give (DTensor placements: FSDP2's rows, TP's columns, FSDP2 over TP's
strided rows, HSDP's replicas; FSDP1's flat runs; uneven and empty pieces), three steps each, the
hyper-parameters varied. The weights must be bitwise equal; rank 0 writes {case: error or ""}."""

import argparse
import json
import traceback
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from parallel.engine.model.optim.layouts import dtensor_layout
from parallel.engine.model.optim.muon import Layout, MuonStep, Piece, replace_step

SETTINGS = [{"lr": 2e-2}, {"lr": 1e-2, "nesterov": False, "weight_decay": 0.0},
            {"lr": 3e-2, "adjust_lr_fn": "match_rms_adamw", "momentum": 0.9}]


def placements_cases(world: int) -> list[tuple]:
    """(name, mesh shape, placements, matrix shape)."""
    if world == 2:
        return [("rows-uneven", (2,), [Shard(0)], (33, 20)),
                ("columns", (2,), [Shard(1)], (20, 33)),
                ("one-row-empty-piece", (2,), [Shard(0)], (1, 8))]
    return [("fsdp2-over-tp", (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], (36, 12)),
            ("rows-and-columns", (2, 2), [Shard(0), Shard(1)], (24, 18)),
            ("hsdp-replicas", (2, 2), [Replicate(), Shard(0)], (30, 16))]


def reference(full: torch.Tensor, grads: list, kwargs: dict) -> torch.Tensor:
    p = torch.nn.Parameter(full.clone())
    opt = torch.optim.Muon([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def sharded(full, grads, kwargs, make):
    """`make(tensor) -> (local parameter, Layout)`; returns the parameter after the steps."""
    p, layout = make(full)
    # built over the matrix as built, then holding the local piece (as the engine's ParamPlan does)
    opt = torch.optim.Muon([torch.nn.Parameter(full.clone())], **kwargs)
    opt.param_groups[0]["params"] = [p]
    replace_step(opt, MuonStep(opt, {id(p): [layout]} if layout is not None else {}))
    for g in grads:
        p.grad = make(g)[0].detach()
        opt.step()
    return p


def dtensor_case(mesh_shape, placements):
    names = ("a", "b")[:len(mesh_shape)]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)

    def make(t):
        p = torch.nn.Parameter(distribute_tensor(t, mesh, placements, src_data_rank=None))
        return p, dtensor_layout(p)
    return make, lambda p: p.full_tensor().detach()


def flat_case(world: int, cut: int):
    """FSDP1's runs: the matrix flattened and cut at `cut` (rank 0 the first run)."""
    def make(t):
        runs = [slice(0, cut), slice(cut, t.numel())]
        pieces = [Piece(flat=r, numel=r.stop - r.start) for r in runs]
        me = dist.get_rank()
        local = torch.nn.Parameter(t.reshape(-1)[runs[me]].clone())
        return local, Layout(tuple(t.shape), dist.group.WORLD, pieces, me)

    def whole(p):
        out = [torch.empty(0)] * world
        dist.all_gather_object(out, p.detach())
        return torch.cat(out)
    return make, whole


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not dist.is_initialized():  # in the suite's shared launches it is (shared.py)
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    cases = [(name, *dtensor_case(mesh, pl), shape)
             for name, mesh, pl, shape in placements_cases(world)]
    if world == 2:
        cases.append(("flat-runs", *flat_case(world, 13), (6, 5)))
    results = {}
    for name, make, whole, shape in cases:
        for i, kwargs in enumerate(SETTINGS):
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + i)  # alike on every rank
            full = torch.randn(shape, generator=g)
            grads = [torch.randn(shape, generator=g) for _ in range(3)]
            try:
                want = reference(full, grads, kwargs)
                got = whole(sharded(full, grads, kwargs, make)).view(shape)
                diff = (got - want).abs().max().item()
                results[f"{name}-{i}"] = "" if torch.equal(got, want) else f"max diff {diff:.3e}"
            except Exception:
                results[f"{name}-{i}"] = traceback.format_exc()
    if dist.get_rank() == 0:
        json.dump(results, open(args.out, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
