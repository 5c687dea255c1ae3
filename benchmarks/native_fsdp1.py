"""FSDP1 by hand: FullyShardedDataParallel with a transformer auto-wrap policy on the decoder layer,
use_orig_params, AdamW, clip; the same job. `build` is the step; as a script, a whole job."""

import functools

import torch
from common import distributed_main, model, token_share
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


def build(a, rank: int, world: int):
    strategies = {3: ShardingStrategy.FULL_SHARD, 2: ShardingStrategy.SHARD_GRAD_OP}
    if a.stage not in strategies:
        raise SystemExit("native_fsdp1 runs FULL_SHARD (stage 3) and SHARD_GRAD_OP (stage 2) only")
    net = model(a.model, a.seed)
    layer = type(net.model.layers[0])
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))  # on CPU, FSDP1 must be told
    net = FSDP(net, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                       transformer_layer_cls={layer}),
               sharding_strategy=strategies[a.stage], use_orig_params=True, device_id=device)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)

    def step(ids):
        loss = token_share(net(input_ids=ids, labels=ids).loss, ids)
        (loss * world).backward()  # FSDP1 averages gradients over the ranks
        if a.clip:
            net.clip_grad_norm_(a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def main():
    distributed_main(build)


if __name__ == "__main__":
    main()
