"""topology.ep: each mixture-of-experts block's experts split over the ep ranks, tokens sent to their
experts' owners and back by all-to-all (torchtitan's token dispatch), with the block's own router,
top-k, weights and shared expert kept: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 as transformers
4.57 writes them.

What one process computes, exactly:
- Each expert runs the same rows through the same weights, on the rank that owns it, whichever
  rank's tokens they are (rows are independent of each other).
- A token's k outputs are weighted after the way back and added in expert order (index_add_ over the
  rows sorted by expert, stably), as the block's own loop adds them.
- Gradients come back through the same all-to-alls (torch.distributed.nn's differentiable one): an
  expert's gradient sums every rank's tokens routed to it.

What a block costs per forward: one all-to-all of the per-expert row counts (ep x experts / ep
integers), read on the host (the next two all-to-alls' splits; the block's own loop reads its routing
to the host too), the rows out and the rows back; backward: the two row all-to-alls again.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.dist import union_names
from parallel.engine.model.moe.experts import a_step_forward
from parallel.kits.names import clean_name


class HeldExperts(nn.ModuleDict):
    """The experts one rank owns, under their original indices (`experts.5.w1.weight` stays so on its
    owner, so checkpoints and optimizer groups read the names one process has); its length is the
    block's expert count, as the model's code reads it."""

    def __init__(self, experts: dict[str, nn.Module], total: int):
        super().__init__(experts)
        self.total = total

    def __getitem__(self, key):
        return super().__getitem__(str(key))

    def __len__(self):
        return self.total

    def __iter__(self):
        return iter(self._modules.values())

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """Called as transformers 5's blocks call their experts (rows, top-k indices, top-k
        weights), with the block's own router, top-k and shared experts around it: the rows go to
        their experts' owners and back (`dispatch`, set by apply_expert_parallel)."""
        return self.dispatch(hidden_states, top_k_index, top_k_weights,
                             a_step_forward(self)).type(hidden_states.dtype)


class Dispatch:
    """Rows to their experts' owners and back, for one block on one rank."""

    def __init__(self, experts: HeldExperts, n_experts: int, ep: int, rank: int, group,
                 touch: bool = False):
        self.experts, self.n, self.ep, self.rank, self.group = experts, n_experts, ep, rank, group
        self.per = n_experts // ep
        # every held expert runs each forward, on no rows where no rank routed a token to it: its
        # gradient is then a zero on every rank, so the ranks sharding it reduce the same experts
        # in the same order (the engine drops the gradients of experts no rank used)
        self.touch = touch
        self.tokens: torch.Tensor | None = None  # rows this rank routed to each expert, training


    def __call__(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor,
                 record: bool = False) -> torch.Tensor:
        """x: (tokens, hidden); selected, weights: (tokens, k). Returns sum_k w_k expert_k(x).
        `record`: add this call's rows per expert to `tokens` (training: on the device, unread)."""
        # the differentiable all-to-all torchtitan uses (torch.distributed.nn.functional's is
        # deprecated since torch 2.13)
        from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

        k, h = selected.shape[-1], x.shape[-1]
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert, then token
        token = order // k
        counts = torch.bincount(flat, minlength=self.n)  # rows this rank sends to each expert
        if record:
            self.tokens = counts if self.tokens is None else self.tokens + counts
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # [source rank][my expert]
        table = torch.stack([counts, got]).view(2, self.ep, self.per).tolist()  # one host read
        send = [sum(row) for row in table[0]]
        recv = [sum(row) for row in table[1]]
        group = self.group if self.group is not None else dist.group.WORLD
        rows = a2a(x[token], recv, send, group)
        out = self._experts(rows, table[1])
        back = a2a(out, send, recv, group)
        back = back * weights.reshape(-1)[order, None].to(back.dtype)
        return x.new_zeros(x.shape[0], h, dtype=back.dtype).index_add_(0, token, back)

    def _experts(self, rows: torch.Tensor, got: list[list[int]]) -> torch.Tensor:
        """The received rows (source-major, expert-minor) through this rank's experts, in place."""
        sizes = [n for source in got for n in source]
        pieces = list(rows.split(sizes))
        for j in range(self.per):
            mine = [src * self.per + j for src in range(self.ep)]
            taken = torch.cat([pieces[i] for i in mine])
            if taken.shape[0] == 0 and not self.touch:
                continue  # no rank routed a token here: no gradient, as on one process
            done = self.experts[self.rank * self.per + j](taken).split([sizes[i] for i in mine])
            for i, part in zip(mine, done):
                pieces[i] = part
        return torch.cat(pieces)  # ep x experts / ep pieces, some empty: never none


def _route(block, x: torch.Tensor):
    """Mixtral / Qwen2-MoE / Qwen3-MoE's routing, as their forwards write it."""
    logits = block.gate(x)
    weights = F.softmax(logits, dim=1, dtype=torch.float)
    weights, selected = torch.topk(weights, block.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):  # Mixtral always normalises
        weights /= weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(x.dtype), selected


def _routed_forward(block, dispatch: Dispatch):
    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        logits, weights, selected = _route(self, x)
        out = dispatch(x, selected, weights, a_step_forward(self)).to(x.dtype)
        if getattr(self, "shared_expert", None) is not None:  # Qwen2-MoE
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(b, s, h), logits

    return types.MethodType(forward, block)


def refuse_unsplit(model: nn.Module, ep: int) -> None:
    """topology.ep on a model without experts held as a ModuleList, refused naming what it has."""
    from parallel.engine.model.moe.experts import fused_blocks
    from parallel.spec.errors import SpecError

    fused = fused_blocks(model)
    raise SpecError([("topology.ep", f"{ep}: {type(model).__name__} has " + (
        f"its experts fused in 3-D tensors ({fused[0][0]}.experts, as transformers 5 builds them), "
        "which topology.ep does not split yet (it splits experts held as a ModuleList)" if fused
        else "no mixture-of-experts blocks (an `experts` ModuleList)") + "; use topology.ep: 1 "
        "(every rank holds every expert: one process's numbers, docs/moe.md)")])


def apply_expert_parallel(blocks: list[tuple[str, nn.Module]], ep: int, rank: int, group,
                          touch: bool = False) -> list[Dispatch]:
    """Each block (moe_blocks(model)) keeps experts [rank x n / ep, (rank + 1) x n / ep), the others
    dropped, and dispatches its tokens over `group` (the ep ranks; None: the world); returns each
    block's Dispatch (its held experts: `.experts`). The routing must be deterministic: a router's
    jitter draws other noise on each rank. `touch`: run every held expert each forward."""
    out = []
    for name, block in blocks:
        n = len(block.experts)
        if n % ep:
            raise ValueError(f"{name}: {n} experts do not split evenly over topology.ep {ep}; pick "
                             "a divisor of the expert count")
        if getattr(block, "jitter_noise", 0):
            raise ValueError(f"{name}: router_jitter_noise {block.jitter_noise} with topology.ep: "
                             "it draws other noise on each rank; build the model with "
                             "router_jitter_noise=0")
        per = n // ep
        # transformers 5's interface: the block calls experts(rows, top-k indices, top-k weights)
        called = type(block.experts).forward is not nn.Module.forward
        held = HeldExperts({str(i): block.experts[i] for i in range(rank * per, (rank + 1) * per)}, n)
        block.experts = held
        dispatch = Dispatch(held, n, ep, rank, group, touch)
        out.append(dispatch)
        if called:
            held.dispatch = dispatch
        elif hasattr(block, "moe"):  # DeepSeek-V3: its own router and shared experts around moe()
            block.moe = types.MethodType(
                lambda self, x, idx, w, d=dispatch: d(x, idx, w, a_step_forward(self)).type(x.dtype),
                block)
        else:
            block.forward = _routed_forward(block, dispatch)
    return out


class ExpertParallel:
    """topology.ep's part of an engine: the experts of each mixture-of-experts block split over the
    ep ranks, which borrow from dp_shard x cp (ParallelDims.expert_mesh); the backend shards each
    held expert over the ranks holding the same ones (`shard_mesh`, with the replicas under hybrid
    sharding).

    What one process computes: an expert's gradient on its owner sums every ep rank's tokens routed
    to it (the all-to-all's backward), and the sharded reduction adds the other replicas' (ranks of
    `shard_mesh`), so the divide factor over them is the whole data-parallel x cp count
    (`divide_by`), as the dense parameters' mean is. The squares of the experts' gradients add
    over the ep group (each rank holds other experts) for the global norm."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]], dims,
                 device_type: str):
        mesh = dims.expert_mesh(device_type)
        self.ep, self.group = dims.ep, mesh["ep"].get_group()
        self.shard_mesh = (mesh["dp_replicate", "dp_mod_ep"] if dims.dp_replicate > 1
                           else mesh["dp_mod_ep"])
        self.divide_by = dims.dp_cp
        whole = {clean_name(n) for n in model.state_dict()}
        self.dispatches = apply_expert_parallel(blocks, self.ep, mesh["ep"].get_local_rank(),
                                                self.group, touch=True)
        self.held = [d.experts for d in self.dispatches]
        self.blocks = [name for name, _ in blocks]
        # the model's entries other ep ranks hold: a checkpoint's are not this rank's to read
        self.elsewhere = frozenset(whole - {clean_name(n) for n in model.state_dict()})
        self.prefixes = tuple(clean_name(name) + "." for name, m in model.named_modules()
                              if isinstance(m, HeldExperts))
        self._whole: list[list[str]] | None = None

    @functools.cached_property
    def param_ids(self) -> frozenset[int]:
        """The held experts' parameters, read at the first step: after sharding, which replaces
        them (fully_shard's DTensor parameters are new objects)."""
        return frozenset(id(p) for held in self.held for p in held.parameters())

    def units(self, within: nn.Module | None = None) -> list[nn.Module]:
        """Each held expert (in `within` only, where given: one of a rank's pipeline stages), the
        unit the backend shards over `shard_mesh`."""
        inside = None if within is None else {id(m) for m in within.modules()}
        return [expert for held in self.held for expert in held.values()
                if inside is None or id(expert) in inside]

    def take_tokens(self, device) -> torch.Tensor:
        """Rows this rank routed to each expert (blocks x experts, float) since the last take,
        for the trackers (summed over ranks in the step's loss reduction at a logging step)."""
        out = torch.stack([d.tokens.float() if d.tokens is not None else
                           torch.zeros(d.n, device=device) for d in self.dispatches])
        for d in self.dispatches:
            d.tokens = None
        return out

    def load_metrics(self, tokens: torch.Tensor) -> tuple[list[str], torch.Tensor]:
        """The trackers' view of `tokens` (blocks x experts, summed over every rank and the steps
        since the last log), as names and one device tensor (read once, at the logging step): each
        block's load imbalance (its busiest expert over the mean, 1 when balanced) and unused
        experts, and the tokens each expert index took over all blocks."""
        mean = tokens.mean(dim=1).clamp_min(1e-9)
        names = [f"moe/{b}/imbalance" for b in self.blocks]
        names += [f"moe/{b}/unused_experts" for b in self.blocks]
        names += ["moe/imbalance"] + [f"moe/tokens/expert_{i}" for i in range(tokens.shape[1])]
        imbalance = tokens.max(dim=1).values / mean
        return names, torch.cat([imbalance, (tokens == 0).sum(dim=1).float(),
                                 imbalance.max().reshape(1), tokens.sum(dim=0)])

    def gather_whole(self, state: dict) -> dict:
        """A whole-model state dict (every rank's, on every rank: gather_model) from this rank's,
        which holds its own experts only: the held experts' entries exchanged over the ep group."""
        mine = {k: v for k, v in state.items() if k.startswith(self.prefixes)}
        gathered: list = [None] * self.ep
        dist.all_gather_object(gathered, mine, group=self.group)
        whole = dict(state)
        for each in gathered:
            whole.update(each)
        return whole

    def whole_groups(self, names: list[list[str]]) -> list[list[str]]:
        """Each optimizer group's names over every ep rank's experts, gathered at the first save."""
        if self._whole is None:
            self._whole = union_names(names, self.group)
        return self._whole
