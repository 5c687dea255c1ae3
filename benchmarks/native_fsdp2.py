"""FSDP2 by hand: fully_shard each decoder layer, then the root; AdamW; clip; the same job.
`build` is the loop's step (polyshard bench --vs-native alternates it with polyshard's in one launch);
run as a script, it is a whole training job."""

import torch
from common import distributed_main, model, token_share
from torch.distributed.fsdp import FSDPModule, fully_shard


def build(a, rank: int, world: int):
    if a.stage not in (2, 3):
        raise SystemExit("native_fsdp2 runs FULL_SHARD (stage 3) and SHARD_GRAD_OP (stage 2) only")
    net = model(a.model, a.seed)
    # torchtitan's apply_fsdp_to_decoder: the embedding, [norm, lm_head] kept gathered after
    # forward (backward needs them first), each block, then the root with torch's default
    reshard = a.stage == 3
    fully_shard(net.model.embed_tokens, reshard_after_forward=reshard)
    fully_shard([net.model.norm, net.lm_head], reshard_after_forward=False)
    for layer in net.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(net)
    for module in net.modules():  # torchtitan: the loss is normalised by the global token count
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if not torch.cuda.is_available():  # gloo has no PREMUL_SUM: factor 1 is a plain SUM
                module.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)

    def step(ids):
        loss = token_share(net(input_ids=ids, labels=ids).loss, ids)
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
