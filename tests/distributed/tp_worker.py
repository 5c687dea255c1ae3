"""FSDP2 + tensor parallelism on a (dp_shard, tp) mesh of gloo ranks, built from the model's own HF
tp plan (backends/fsdp/tp.py), against one process on the global batch: losses, gradient norms with
clipping, and each rank's share of a split projection. Rank 0 writes the result to --out."""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from backends.fsdp.tp import apply_tp, clip_grad_norm_by_mesh, hf_tp_plan
from parallel.toy import build_llama, llama_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // args.tp
    mesh = init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    reference = build_llama(llama_config("tiny"))
    model = build_llama(llama_config("tiny"))
    model.load_state_dict(reference.state_dict())
    plan = hf_tp_plan(model)
    apply_tp(model, mesh["tp"], plan)  # TP first, then FSDP2 over the data-parallel dim
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    q = model.model.layers[0].self_attn.q_proj.weight
    ours = torch.optim.AdamW(model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rows, steps = 8, []
    for _ in range(4):
        ids = torch.randint(0, 256, (rows, 16), generator=g)
        mine = ids[(rank // args.tp) * rows // dp:(rank // args.tp + 1) * rows // dp]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        norm = clip_grad_norm_by_mesh(model.parameters(), 0.5)
        ours.step()
        ours.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank of a tp group holds its dp slice's loss
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        theirs.step()
        theirs.zero_grad()
        steps.append({"loss": float(total) / world, "ref_loss": float(ref_loss),
                      "norm": float(norm), "ref_norm": float(ref_norm)})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": steps, "plan": plan, "q_local": list(q.to_local().shape),
                       "q_full": list(q.shape), "q_placements": [str(x) for x in q.placements]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
