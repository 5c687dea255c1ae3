"""Pipeline parallelism by hand, the way torchtitan writes it (distributed/pipeline_parallel.py and
trainer.py): the model split into stage modules by layer ranges (the embedding on the first, the norm
and head on the last), each stage sharded by fully_shard over the data-parallel mesh dim (each
block, then the stage), torch.distributed.pipelining's schedule built with `scale_grads=False` over a
loss summed per micro-batch and divided by the step's global target count, `schedule.step` once per
step, the grad norm's square summed over the pp group before clipping. Hugging Face Llama's modules,
run by a stage forward written here (torchtitan's own models skip missing modules the same way).
Mesh (pp, dp), pp outermost. `build` is the loop's step (bench --vs-native); as a script, a whole job.
"""

import torch
from common import IGNORE_INDEX, distributed_main, model
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B"}


class Stage(nn.Module):
    """Layers [start, end) of a Hugging Face Llama, with its embedding on the first stage and its
    norm and head on the last (None elsewhere, as torchtitan's split leaves them)."""

    def __init__(self, net, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = net.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): net.model.layers[i] for i in range(start, end)})
        self.rotary, self.config = net.model.rotary_emb, net.config
        self.norm = net.model.norm if last else None
        self.output = net.lm_head if last else None

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary(h, positions)
        from transformers.masking_utils import create_causal_mask

        # the causal mask as the model's own forward makes it (eager attention takes it whole)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        return self.output(self.norm(h)) if self.output is not None else h


def build(a, rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, schedules

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    mesh = init_device_mesh(device.type, (a.pp, world // a.pp), mesh_dim_names=("pp", "dp"))
    pp_group, dp_mesh = mesh["pp"].get_group(), mesh["dp"]
    pp_rank, virtual = mesh["pp"].get_local_rank(), 2 if a.schedule == "interleaved_1f1b" else 1
    net = model(a.model, a.seed)
    n_stages, n_layers = a.pp * virtual, len(net.model.layers)
    size, extra = divmod(n_layers, n_stages)
    starts = [i * size + min(i, extra) for i in range(n_stages)] + [n_layers]
    parts, stages = [], []
    for s in (pp_rank + k * a.pp for k in range(virtual)):  # torch's loop: r, r + pp, ...
        part = Stage(net, starts[s], starts[s + 1], s == 0, s == n_stages - 1)
        for layer in part.layers.values():  # torchtitan's apply_fsdp, per model part
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(part, mesh=dp_mesh)
        part.set_gradient_divide_factor(1.0)  # the loss is already divided by the global count
        if device.type == "cpu":  # gloo has no PREMUL_SUM: factor 1 is a plain SUM
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        stage = PipelineStage(part, s, n_stages, device, group=pp_group)
        if device.type == "cpu":  # torch 2.9's NCCL warm-up handshake breaks gloo (docs/pipeline.md)
            stage._get_init_p2p_neighbors_ops = list
        parts.append(part)
        stages.append(stage)
    count = {}

    def loss_fn(logits, labels):  # summed over the micro-batch's targets / the step's count
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, logits.shape[-1], num_items_in_batch=count["total"])

    cls = getattr(schedules, SCHEDULES[a.schedule])
    schedule = cls(stages if virtual > 1 else stages[0], n_microbatches=a.microbatches,
                   loss_fn=loss_fn, scale_grads=False)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.1)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step(ids):
        total = (ids[..., 1:] != IGNORE_INDEX).sum()  # the step's targets over the dp ranks
        if dp_mesh.size() > 1:
            torch.distributed.all_reduce(total, group=dp_mesh.get_group())
        count["total"] = total
        losses = []
        schedule.step(*([ids] if first else []), target=ids if last else None, losses=losses)
        if a.clip:  # torchtitan's clip_grad_norm_ under pp: the norm's square summed over stages
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            square = norm.square()
            torch.distributed.all_reduce(square, group=pp_group)
            torch.nn.utils.clip_grads_with_norm_(params, a.clip, square.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.stack(losses).sum() if last else torch.zeros((), device=device)

    return step


def main():
    distributed_main(build)


if __name__ == "__main__":
    main()
