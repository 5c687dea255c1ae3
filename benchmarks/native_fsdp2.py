"""FSDP2 by hand: fully_shard each decoder layer, then the root; AdamW; clip; the same job.
`build` is the loop's step (polyshard bench --vs-native alternates it with polyshard's in one launch);
run as a script, it is a whole training job."""

import torch
from common import distributed_main, model
from torch.distributed.fsdp import fully_shard


def build(a, rank: int, world: int):
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

    return step


def main():
    distributed_main(build)


if __name__ == "__main__":
    main()
