"""Native checkpoints written without polyshard, the way users' own loops write them: an FSDP2 loop
saving torch DCP from get_state_dict, a DeepSpeed ZeRO-2 loop calling save_checkpoint, and an XLA FSDP
v1 loop saving per-rank shard files with shard metadata. 3 AdamW steps on the shared global batches,
from the reference initial weights; `polyshard ckpt import` then has to carry on from them."""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from parity_worker import global_batches, optimizer_arg

from parallel.toy import build_llama, llama_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: xla_shards.py

STEPS, ROWS = 3, 4


SIZES = {"tiny": {}, "56m": {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376,
                             "num_hidden_layers": 8, "num_attention_heads": 8,
                             "num_key_value_heads": 8}}


def model_and_batches(size: str = "tiny"):
    torch.manual_seed(0)
    return build_llama(llama_config("tiny", **SIZES[size])), global_batches(5, 1, ROWS)


def fsdp2_trained(size: str = "tiny"):
    """An FSDP2 loop as torchtitan's docs write it: every block, then the root; 3 AdamW steps."""
    from torch.distributed.fsdp import fully_shard

    model, batches = model_and_batches(size)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    cls, kw = optimizer_arg("adamw")
    opt = cls(model.parameters(), **kw)
    rank, rows = dist.get_rank(), ROWS // dist.get_world_size()
    for ids in batches[:STEPS]:
        mine = ids[rank * rows:(rank + 1) * rows]
        model(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fsdp2_dcp(out: Path, size: str = "tiny"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp2_trained(size)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)


def accelerate_fsdp2(out: Path):
    """The same loop saved by Accelerate 1.11's own FSDP writers (what `accelerator.save_state` and
    HF Trainer's checkpoint-N call with SHARDED_STATE_DICT): pytorch_model_fsdp_0/ and
    optimizer_0/, each a DCP, and Trainer's trainer_state.json with the step."""
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from transformers import TrainerState

    model, opt = fsdp2_trained()
    state = PartialState()  # the process group already made: Accelerate reads rank and world
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    save_fsdp_model(plugin, state, model, str(out))
    save_fsdp_optimizer(plugin, state, opt, model, str(out))
    if state.is_main_process:
        TrainerState(global_step=STEPS).save_to_json(str(out / "trainer_state.json"))


def deepspeed_zero2(out: Path, stage: int = 2, size: str = "tiny", frozen: bool = False):
    """DeepSpeed's own loop; `frozen`: the embedding and the first block's attention untrained (a
    LoRA run's base), outside the optimizer, as users freeze them."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    model, batches = model_and_batches(size)
    if frozen:
        for p in (*model.model.embed_tokens.parameters(), *model.model.layers[0].self_attn.parameters()):
            p.requires_grad_(False)
    cls, kw = optimizer_arg("adamw")
    rows = ROWS // dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": stage}}
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=cls(trained, **kw), config=config)
    rank = dist.get_rank()
    for ids in batches[:STEPS]:
        mine = ids[rank * rows:(rank + 1) * rows]
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    engine.save_checkpoint(str(out))


def deepspeed_universal_resume(root: Path):
    """Plain DeepSpeed ZeRO-2 (no polyshard) loads polyshard's `ckpt export --to deepspeed-universal`
    output with load_universal and runs steps 4-5; rank 0 writes the losses."""
    import json

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    torch.manual_seed(7)  # other weights than the run's: only the load can give its losses
    model, batches = build_llama(llama_config("tiny")), global_batches(5, 1, ROWS)
    cls, kw = optimizer_arg("adamw")
    rows = ROWS // dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 2}, "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=cls(model.parameters(), **kw),
                                      config=config)
    engine.load_checkpoint(str(root / "exported_universal"))
    rank, losses = dist.get_rank(), []
    for ids in batches[STEPS:]:
        mine = ids[rank * rows:(rank + 1) * rows]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    if rank == 0:
        (root / "universal_losses.json").write_text(json.dumps({
            "loss": losses, "global_steps": engine.global_steps}))


def xla_fsdp_v1(out: Path, size: str = "tiny", flavor: str = "", ranks: int = 1):
    """`flavor`: "" (each parameter sharded flat), "flat" (flatten_parameters, each decoder layer an
    XLA FSDP of its own inside the model's) or "dim0" (shard_param_on_dim_0). `ranks`: the files
    written as XLA FSDP would have written them at that many ranks (tests/xla_shards.py: this host's
    PJRT CPU client runs XLA FSDP v1 at world size 1 only)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as XFSDP
    from xla_shards import reshard

    model, batches = model_and_batches(size)
    device = torch_xla.device()
    wrap = {"flat": {"flatten_parameters": True}, "dim0": {"shard_param_on_dim_0": True}}.get(flavor, {})
    model = model.to(device)
    if flavor == "flat":
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = XFSDP(layer, **wrap)
    model = XFSDP(model, **wrap)
    cls, kw = optimizer_arg("adamw")
    opt = cls(model.parameters(), **kw)
    for ids in batches[:STEPS]:
        ids = ids.to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    out.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
             "optimizer": opt.state_dict()}
    rank, world = xr.global_ordinal(), xr.world_size()
    if ranks == world:
        xm.save(state, out / f"ckpt_rank-{rank:08d}-of-{world:08d}.pth", master_only=False)
        return
    on_host = torch.utils._pytree.tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, state)
    for r, part in enumerate(reshard([on_host], ranks)):
        torch.save(part, out / f"ckpt_rank-{r:08d}-of-{ranks:08d}.pth")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--which", required=True,
                   help="comma-separated: fsdp2_dcp,accelerate_fsdp2,deepspeed_zero2,"
                   "deepspeed_zero3,xla,xla_flat,xla_dim0,deepspeed_zero2_frozen,deepspeed_zero3_frozen")
    p.add_argument("--root", required=True)
    p.add_argument("--size", default="tiny", choices=SIZES,
                   help="the model of fsdp2_dcp, deepspeed_zero3 and xla*")
    p.add_argument("--xla-ranks", type=int, default=1, help="xla*: files as saved at that many ranks")
    args = p.parse_args()
    if "xla" not in args.which:
        dist.init_process_group("gloo")
    for name in args.which.split(","):
        if name == "deepspeed_universal_resume":
            deepspeed_universal_resume(Path(args.root))
            continue
        {"fsdp2_dcp": lambda out: fsdp2_dcp(out, args.size), "deepspeed_zero2": deepspeed_zero2,
         "accelerate_fsdp2": accelerate_fsdp2,
         "xla": lambda out: xla_fsdp_v1(out, args.size, ranks=args.xla_ranks),
         "xla_flat": lambda out: xla_fsdp_v1(out, args.size, "flat", args.xla_ranks),
         "xla_dim0": lambda out: xla_fsdp_v1(out, args.size, "dim0", args.xla_ranks),
         "deepspeed_zero3": lambda out: deepspeed_zero2(out, 3, args.size),
         "deepspeed_zero2_frozen": lambda out: deepspeed_zero2(out, 2, frozen=True),
         "deepspeed_zero3_frozen": lambda out: deepspeed_zero2(out, 3, frozen=True)}[name](
            Path(args.root) / name)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
