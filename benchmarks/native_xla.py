"""XLA FSDP v1 by hand (one process on the CPU client; one per chip on a TPU): the same job. `build`
is the step; as a script, a whole job."""

import torch_xla
from common import args, model, run, token_share
from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as XFSDP


def build(a, rank: int, world: int):
    import torch

    device = torch_xla.device()
    net = model(a.model, a.seed).to(device)
    for i, layer in enumerate(net.model.layers):
        net.model.layers[i] = XFSDP(layer, flatten_parameters=a.flatten)
    net = XFSDP(net, flatten_parameters=a.flatten)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)

    def step(ids):
        ids = ids.to(device)
        loss = token_share(net(input_ids=ids, labels=ids).loss, ids)
        loss.backward()
        if a.clip:
            net.clip_grad_norm_(a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        return loss.cpu()

    return step


def main():
    a = args()
    run(a, build(a, 0, 1), 0, 1)


if __name__ == "__main__":
    main()
