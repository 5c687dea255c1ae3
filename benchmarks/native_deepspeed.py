"""DeepSpeed by hand: deepspeed.initialize with a ZeRO config written out; the same job. `build` is
the step; as a script, a whole job. --tp N: AutoTP as DeepSpeed's AutoTP training tutorial enables
it, by the config alone (`tensor_parallel.autotp_size`; DeepSpeed reads the model's Hugging Face tp
plan), a TP group's ranks taking the same rows. --sp N: DeepSpeed's Ulysses (build_sp). --pp N:
DeepSpeed's pipeline engine (build_pp)."""

import deepspeed
import torch
import torch.distributed as dist
from common import args, model, run, token_share
from torch import nn


def build(a, rank: int, world: int):
    if a.sp > 1:
        return build_sp(a, rank, world)
    if a.pp > 1:
        return build_pp(a, rank, world)
    if a.ep > 1:
        return build_ep(a, rank, world)
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


def build_ep(a, rank: int, world: int):
    """--ep N: AutoEP as DeepSpeed 0.19.8 documents it, by the config's `expert_parallel` section
    alone. Its presets match transformers >= 5.0's fused experts only, so on transformers 4.57's
    Qwen3-MoE (an `experts` ModuleList of gate/up/down projections) the layer and expert names are
    given as its custom patterns; AutoEP fuses each block's experts into one tensor per projection
    and dispatches tokens by all-to-all. DeepSpeed averages gradients over the data-parallel ranks."""
    net = model(a.model, a.seed)
    config = {"train_micro_batch_size_per_gpu": a.global_rows // world,
              "gradient_accumulation_steps": 1, "gradient_clipping": a.clip,
              "zero_optimization": {"stage": a.stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2 ** 31 - 1,
              "expert_parallel": {"enabled": True, "autoep_size": a.ep,
                                  "moe_layer_pattern": r"model\.layers\.\d+\.mlp",
                                  "expert_w1": "gate_proj", "expert_w2": "down_proj",
                                  "expert_w3": "up_proj", "num_experts_attr": "num_experts",
                                  "route_norm": True},
              # DeepSpeed builds the optimizer (AutoEP splits its expert parameter groups)
              "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "weight_decay": 0.1,
                                                        "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)

    def step(ids):
        ids = ids.to(engine.device)
        loss = token_share(engine(input_ids=ids, labels=ids).loss, ids)
        engine.backward(loss * world)
        engine.step()
        return loss

    return step


def build_sp(a, rank: int, world: int):
    """--sp N: Ulysses as DeepSpeed's ALST tutorial and accelerate's sequence-parallelism guide
    write it: UlyssesSPAttentionHF registered with transformers (sdpa), its mpu handed to
    deepspeed.initialize, each rank the sp group's rows cut to its chunk with global position_ids
    and labels shifted before the cut (what UlyssesSPDataLoaderAdapter does), the loss computed
    from the logits on shift_labels, and the ranks' losses combined by the guide's weighted
    average over the sp group (differentiable all_gather)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    net = model(a.model, a.seed)
    net.set_attn_implementation("sdpa")  # Ulysses wraps sdpa / flash, not eager
    rows = a.global_rows // (world // a.sp)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=net, core_attn_implementation="sdpa", sequence_parallel_size=a.sp,
        micro_batch_size=rows, seq_length=a.seq, seq_length_is_variable=True)
    config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
              "gradient_clipping": a.clip, "zero_optimization": {"stage": a.stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 2 ** 31 - 1}
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config, mpu=mpu)
    group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()

    def step(ids):
        ids = ids.to(engine.device)
        chunk = ids.shape[1] // a.sp
        mine = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        shift = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:]
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logits = engine(input_ids=ids[:, mine], position_ids=positions[:, mine]).logits
        shift_labels = shift[:, mine].contiguous()
        loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                           vocab_size=engine.module.config.vocab_size)
        losses = torch.distributed.nn.functional.all_gather(loss, group=group)
        good = (shift_labels != -100).view(-1).sum()
        goods = torch.distributed.nn.functional.all_gather(good, group=group)
        total = sum(losses[r] * goods[r] for r in range(a.sp) if goods[r] > 0)
        loss = total / max(sum(goods), 1)
        engine.backward(loss)
        engine.step()
        return loss

    return step


class Embed(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.embed_tokens = net.model.embed_tokens

    def forward(self, ids):
        return self.embed_tokens(ids)


class Block(nn.Module):
    """One decoder layer, its rotary embeddings and causal mask made as the model's forward
    makes them."""

    def __init__(self, net, i: int):
        super().__init__()
        self.layer, self.rotary, self.config = net.model.layers[i], net.model.rotary_emb, net.config

    def forward(self, h):
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=positions)
        return self.layer(h, attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rotary(h, positions))


class Head(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.norm, self.lm_head = net.model.norm, net.lm_head

    def forward(self, h):
        return self.lm_head(self.norm(h))


def build_pp(a, rank: int, world: int):
    """--pp N: DeepSpeed's pipeline tutorial: the model as a list of layers in a PipelineModule
    (partition_method "uniform": the embedding with the first layers, the last layers with the
    head), a loss_fn on each micro-batch (the mean over its targets), engine.train_batch over the
    step's --microbatches micro-batches (their mean loss, on every rank). DeepSpeed's clipping
    (gradient_clipping) as its config writes it."""
    from deepspeed.pipe import PipelineModule
    from transformers.loss.loss_utils import ForCausalLMLoss

    net = model(a.model, a.seed)
    layers = [Embed(net), *(Block(net, i) for i in range(len(net.model.layers))), Head(net)]
    pipe = PipelineModule(layers=layers, num_stages=a.pp, partition_method="uniform",
                          loss_fn=lambda logits, labels: ForCausalLMLoss(logits, labels,
                                                                         logits.shape[-1]))
    rows = a.global_rows // (world // a.pp)
    config = {"train_micro_batch_size_per_gpu": rows // a.microbatches,
              "gradient_accumulation_steps": a.microbatches, "gradient_clipping": a.clip,
              "zero_optimization": {"stage": a.stage}, "steps_per_print": 2 ** 31 - 1}
    opt = torch.optim.AdamW(pipe.parameters(), lr=a.lr, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=opt, config=config)

    def step(ids):
        ids = ids.to(engine.device)
        loss = engine.train_batch(iter([(c, c) for c in ids.tensor_split(a.microbatches)]))
        return loss / world  # this rank's share: run() sums the shares over the ranks

    return step


def teardown():
    """What --sp leaves in the process beyond its job (benchmarks/cases.py runs several loops in one
    process, and the suite's shared launches more jobs after it): DeepSpeed's Ulysses registration
    replaced transformers' "sdpa" attention for every model (ALL_ATTENTION_FUNCTIONS) and keeps its
    sequence-parallel group in module globals (measured: the next job's GPT-2 forward went through
    it and failed)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import deepspeed.runtime.sequence_parallel.parallel_state_sp as sp_state

    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    for name in dir(sp_state):
        if name.startswith("_SEQUENCE") and not callable(getattr(sp_state, name)):
            setattr(sp_state, name, None)


def main():
    a = args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    run(a, build(a, rank, world), rank, world)


if __name__ == "__main__":
    main()
