"""FSDP2 by hand: fully_shard each decoder layer, then the root; AdamW; clip; the same job."""

import torch
import torch.distributed as dist
from common import args, model, run
from torch.distributed.fsdp import fully_shard


def main():
    a = args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.stage not in (2, 3):
        raise SystemExit("native_fsdp2 runs FULL_SHARD (stage 3) and SHARD_GRAD_OP (stage 2) only")
    net = model(a.model, a.seed)
    for layer in net.model.layers:
        fully_shard(layer, reshard_after_forward=a.stage == 3)
    fully_shard(net, reshard_after_forward=a.stage == 3)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)

    def step(ids):
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    run(a, step, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
