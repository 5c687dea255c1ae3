"""FSDP2 by hand: fully_shard each decoder layer, then the root; AdamW; clip; the same job. With
--tp N, tensor parallelism first, as torchtitan's parallelize_llama does it (apply_tp, then
apply_fsdp over the data-parallel mesh dim), on Hugging Face Llama's module names. `build` is the
loop's step (polyshard bench --vs-native alternates it with polyshard's in one launch); run as a
script, it is a whole training job."""

import torch
from common import distributed_main, model, token_share
from torch.distributed.fsdp import FSDPModule, fully_shard


def apply_tp(net, tp_mesh):
    """torchtitan's apply_tp without sequence or loss parallelism: attention and MLP projections
    column- then row-parallel, the output layer's vocabulary split and its logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    for block in net.model.layers:
        parallelize_module(block, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()})
    parallelize_module(net, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def clip_(params, max_norm: float) -> None:
    """clip_grad_norm_ where gradients live on two meshes ((dp, tp) for the split projections, dp
    for the rest): torch's stacks per-tensor norms, which DTensor refuses across meshes, so each
    mesh's norm is made whole and the squares summed."""
    from torch.distributed.tensor import DTensor

    by_mesh = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]) for ps in by_mesh.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.stack(norms).square().sum().sqrt()
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)


def muon_and_adamw(net, lr: float, group) -> list:
    """Muon on the hidden matrices, AdamW on the rest, as distributed Muon implementations write
    it over FSDP2's row shards: each matrix's update gathered at an owner rank (round-robin),
    orthogonalized there with torch's Newton-Schulz, the result scattered back; two collectives
    per matrix (the PyTorch distributed-Muon design's gather_fn / redistribute_fn)."""
    import torch.distributed as dist
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    hidden = [p for n, p in net.named_parameters()
              if p.ndim == 2 and "embed" not in n and "lm_head" not in n]
    rest = [p for p in net.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=lr)
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    @torch.no_grad()
    def muon_step():
        g = muon.param_groups[0]
        for i, p in enumerate(hidden):
            local, grad = p.to_local(), p.grad.to_local()
            buf = muon.state[p].setdefault("momentum_buffer", torch.zeros_like(grad))
            buf.lerp_(grad, 1 - g["momentum"])
            update = grad.lerp(buf, g["momentum"]).bfloat16()
            rows = -(-p.shape[0] // world)  # FSDP2's row chunks, the last padded to gather
            padded = torch.zeros(rows, p.shape[1], dtype=torch.bfloat16)
            padded[:update.shape[0]] = update
            owner = dist.get_global_rank(group, i % world)
            parts = [torch.empty_like(padded) for _ in range(world)] if rank == i % world else None
            dist.gather(padded, parts, dst=owner, group=group)
            if parts is not None:
                whole = _zeropower_via_newtonschulz(torch.cat(parts)[:p.shape[0]],
                                                    g["ns_coefficients"], g["ns_steps"], g["eps"])
                parts = list(torch.cat([whole, torch.zeros(rows * world - p.shape[0], p.shape[1],
                                                           dtype=whole.dtype)]).chunk(world))
            dist.scatter(padded, parts, src=owner, group=group)
            local.mul_(1 - g["lr"] * g["weight_decay"])
            local.add_(padded[:local.shape[0]], alpha=-_adjust_lr(g["lr"], None, p.shape))

    muon.step = lambda closure=None: muon_step()
    return [muon, torch.optim.AdamW(rest, lr=lr, weight_decay=0.1)]


def convert_float8(net):
    """torchtitan's float8 converter, as its float8 docs write it: Float8Linear for every linear but
    the output layer, with FSDP2's float8 all-gather; emulated where there is no float8 matmul."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fast = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=not fast)
    convert_to_float8_training(net, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")


def build(a, rank: int, world: int):
    if a.stage not in (2, 3):
        raise SystemExit("native_fsdp2 runs FULL_SHARD (stage 3) and SHARD_GRAD_OP (stage 2) only")
    net = model(a.model, a.seed)
    if a.fp8:
        if a.tp > 1:
            raise SystemExit("native_fsdp2 --fp8 runs data parallel only")
        convert_float8(net)
    dp_mesh, dp_group = None, None
    if a.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu",
                                (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
        apply_tp(net, mesh["tp"])
        dp_mesh, dp_group = mesh["dp"], mesh["dp"].get_group()
    # torchtitan's apply_fsdp_to_decoder: the embedding, [norm, lm_head] kept gathered after
    # forward (backward needs them first), each block, then the root with torch's default
    reshard = a.stage == 3
    fully_shard(net.model.embed_tokens, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard([net.model.norm, net.lm_head], mesh=dp_mesh, reshard_after_forward=False)
    for layer in net.model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(net, mesh=dp_mesh)
    for module in net.modules():  # torchtitan: the loss is normalised by the global token count
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if not torch.cuda.is_available():  # gloo has no PREMUL_SUM: factor 1 is a plain SUM
                module.set_force_sum_reduction_for_comms(True)
    opts = muon_and_adamw(net, a.lr, dp_group) if a.muon else \
        [torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)]

    def step(ids):
        loss = token_share(net(input_ids=ids, labels=ids).loss, ids, dp_group)
        loss.backward()
        if a.clip:
            (clip_ if a.tp > 1 else torch.nn.utils.clip_grad_norm_)(net.parameters(), a.clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if a.fp8:  # torchtitan: one all-reduce of every weight's amax for the next gathers
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(net)
        return loss

    return step


def main():
    distributed_main(build)


if __name__ == "__main__":
    main()
