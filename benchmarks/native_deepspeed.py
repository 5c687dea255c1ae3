"""DeepSpeed by hand: deepspeed.initialize with a ZeRO config written out; the same job. `build` is
the step; as a script, a whole job. --tp N: AutoTP as DeepSpeed's AutoTP training tutorial enables
it, by the config alone (`tensor_parallel.autotp_size`; DeepSpeed reads the model's Hugging Face tp
plan), a TP group's ranks taking the same rows."""

import deepspeed
import torch
import torch.distributed as dist
from common import args, model, run, token_share


def build(a, rank: int, world: int):
    net = model(a.model, a.seed)
    dp = world // a.tp
    config = {"train_micro_batch_size_per_gpu": a.global_rows // dp,
              "gradient_accumulation_steps": 1, "gradient_clipping": a.clip,
              "zero_optimization": {"stage": a.stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2 ** 31 - 1}
    if a.tp > 1:
        config["tensor_parallel"] = {"autotp_size": a.tp}
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    group = None
    if a.tp > 1:  # the targets are counted over the data-parallel ranks (a TP group's rows once)
        from deepspeed.utils import groups

        group = groups.get_data_parallel_group()

    def step(ids):
        ids = ids.to(engine.device)  # DeepSpeed moves the model, not the batch
        loss = token_share(engine(input_ids=ids, labels=ids).loss, ids, group)
        engine.backward(loss * dp)  # DeepSpeed averages gradients over the data-parallel ranks
        engine.step()
        return loss

    return step


def main():
    a = args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    run(a, build(a, rank, world), rank, world)


if __name__ == "__main__":
    main()
