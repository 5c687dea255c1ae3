"""Expert parallelism by hand, the way torchtitan writes it (models/common/token_dispatcher.py's
AllToAllTokenDispatcher, moe_sharding.py and distributed/utils.py's clip_grad_norm_ under EP), on
Hugging Face's Mixtral / Qwen2-MoE / Qwen3-MoE blocks as transformers 5 builds them (their router,
which returns its own top-k, and fused `experts` tensors, of which each rank keeps its experts'
rows as modules of their own: GroupedExperts' for-loop path):
- the ep ranks are the innermost of the data-parallel ranks (mesh (dp_mod_ep, ep));
- each block keeps its ep rank's experts (torchtitan shards its grouped experts' dim 0 over ep);
- the dispatch: tokens reordered by expert, the per-expert counts exchanged by all-to-all, the split
  sizes copied to the host (torchtitan's one device-to-host sync per block), the rows sent by
  all-to-all, permuted to expert-major for this rank's experts, run, permuted back, returned by
  all-to-all, weighted by their routing scores and summed per token;
- FSDP2 as torchtitan applies it to MoE models: each expert over dp_mod_ep (the ranks holding the
  same experts) with the gradient divided by every data-parallel rank (its
  gradient_divide_factor), each block and the root over all data-parallel ranks;
- the loss normalised by the global target count (trainer.py), AdamW, the norm's expert part summed
  over ep before clipping.
`build` is the loop's step (bench --vs-native); as a script, a whole job."""

import torch
import torch.nn.functional as F
from common import distributed_main, model, token_share
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.fsdp import FSDPModule, fully_shard


class Expert(nn.Module):
    """One expert's rows of the fused tensors, as torchtitan names an expert's weights: w1 (gate)
    and w3 (up), the halves of gate_up [2F, D], and w2 (down [D, F])."""

    def __init__(self, gate_up, down, act):
        super().__init__()
        gate, up = gate_up.chunk(2)
        self.w1, self.w3 = nn.Parameter(gate.clone()), nn.Parameter(up.clone())
        self.w2, self.act = nn.Parameter(down.clone()), act

    def forward(self, x):
        return F.linear(self.act(F.linear(x, self.w1)) * F.linear(x, self.w3), self.w2)


class EPBlock(nn.Module):
    """An HF MoE block's router (and shared expert) with this ep rank's experts and the dispatch."""

    def __init__(self, block, ep_mesh):
        super().__init__()
        self.gate, self.ep_mesh = block.gate, ep_mesh
        fused = block.experts
        self.num_experts = fused.gate_up_proj.shape[0]
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.local = self.num_experts // ep
        self.experts = nn.ModuleList(
            Expert(fused.gate_up_proj[e].detach(), fused.down_proj[e].detach(), fused.act_fn)
            for e in range(rank * self.local, (rank + 1) * self.local))
        self.shared_expert = getattr(block, "shared_expert", None)
        self.shared_expert_gate = getattr(block, "shared_expert_gate", None)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        _, scores, ids = self.gate(x)  # transformers 5's router: softmax, top-k, normalisation
        out = self.dispatch_combine(x, scores.to(x.dtype), ids)
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(b, s, h)

    def _permute(self, routed, got):
        """torchtitan's _permute: rank-major (e0 r0, e1 r0, .., e0 r1, ..) to expert-major (e0 r0,
        e0 r1, .., e1 r0, ..) on the device; the rows each local expert takes."""
        ep = self.ep_mesh.size()
        t_mat = got.view(ep, self.local)
        starts = (got.cumsum(0) - got).view(ep, self.local).t().reshape(-1)
        lens = t_mat.t().reshape(-1)
        seg = torch.arange(lens.shape[0], device=got.device).repeat_interleave(
            lens, output_size=routed.shape[0])
        out_starts = lens.cumsum(0) - lens
        indices = starts[seg] + torch.arange(seg.shape[0], device=got.device) - out_starts[seg]
        return routed[indices], indices, t_mat.sum(0)

    def dispatch_combine(self, x, scores, ids):
        ep = self.ep_mesh.size()
        # _local_reorder: (token, slot) pairs sorted by expert
        flat = ids.view(-1)
        sorted_slots = torch.argsort(flat, stable=True)
        tokens = sorted_slots // ids.shape[-1]
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        with torch.no_grad():  # _token_count_exchange, then _sync_token_count_exchange
            got = all_to_all_single(per_expert, None, None, group=self.ep_mesh)
            got = torch.ops._c10d_functional.wait_tensor(got)
            input_splits = per_expert.view(ep, -1).sum(dim=1).to(torch.device("cpu"),
                                                                  non_blocking=True)
            output_splits = got.view(ep, -1).sum(dim=1).to(torch.device("cpu"), non_blocking=False)
            input_splits, output_splits = input_splits.tolist(), output_splits.tolist()
        routed = all_to_all_single_autograd(x[tokens], output_splits, input_splits, self.ep_mesh)
        permuted, indices, per_local = self._permute(routed, got)
        # GroupedExperts' for-loop path (what runs experts as separate modules): the per-expert
        # row counts read on the host to split the rows
        outs = [expert(rows) for expert, rows in
                zip(self.experts, permuted.split(per_local.tolist()))]
        done = routed.new_empty(routed.shape)
        done[indices] = torch.cat(outs)  # _unpermute
        back = all_to_all_single_autograd(done, input_splits, output_splits, self.ep_mesh)
        weighted = back * scores.view(-1)[sorted_slots, None]
        return torch.zeros_like(x).index_add_(0, tokens, weighted)


def clip_(dense, experts, max_norm: float, ep_group):
    """torchtitan's clip_grad_norm_ under EP: the norms of the non-EP and EP parameters apart
    (each DTensor norm made whole over its mesh), the EP part's square summed over ep, combined."""
    from torch.distributed.tensor import DTensor

    def norm(ps):
        n = torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None])
        return n.full_tensor() if isinstance(n, DTensor) else n

    ep_square = norm(experts) ** 2
    torch.distributed.all_reduce(ep_square, group=ep_group)
    total = (norm(dense) ** 2 + ep_square).sqrt()
    torch.nn.utils.clip_grads_with_norm_([p for p in dense if p.grad is not None], max_norm, total)
    torch.nn.utils.clip_grads_with_norm_([p for p in experts if p.grad is not None], max_norm,
                                         total)


def build(a, rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world // a.ep, a.ep), mesh_dim_names=("dp_mod_ep", "ep"))
    dp_mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    net = model(a.model, a.seed)
    experts = []
    for layer in net.model.layers:
        name = "block_sparse_moe" if hasattr(layer, "block_sparse_moe") else "mlp"
        moe = EPBlock(getattr(layer, name), mesh["ep"])
        setattr(layer, name, moe)
        experts += list(moe.experts)
    reshard = a.stage == 3
    for expert in experts:  # torchtitan: experts over dp_mod_ep, divided by every dp rank
        fully_shard(expert, mesh=mesh["dp_mod_ep"], reshard_after_forward=reshard)
        expert.set_gradient_divide_factor(1.0)
    fully_shard(net.model.embed_tokens, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard([net.model.norm, net.lm_head], mesh=dp_mesh, reshard_after_forward=False)
    for layer in net.model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(net, mesh=dp_mesh)
    for module in net.modules():  # the loss is normalised by the global token count
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if device == "cpu":  # gloo has no PREMUL_SUM: factor 1 is a plain SUM
                module.set_force_sum_reduction_for_comms(True)
    expert_params = [p for e in experts for p in e.parameters()]
    held = {id(p) for p in expert_params}
    dense = [p for p in net.parameters() if id(p) not in held]
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.1)

    def step(ids):
        loss = token_share(net(input_ids=ids, labels=ids).loss, ids)
        loss.backward()
        if a.clip:
            clip_(dense, expert_params, a.clip, mesh["ep"].get_group())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def main():
    distributed_main(build)


if __name__ == "__main__":
    main()
