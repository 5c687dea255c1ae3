"""`torch.optim.Muon` on sharded matrices, one process's update exactly, the work O(model / N).

Muon's step is elementwise but for one part: the momentum (`buf.lerp_(grad, 1 - momentum)`, the
Nesterov blend), the weight decay and the final add run on any shard as on the whole, while the
Newton-Schulz orthogonalization needs each whole matrix. A shard (FSDP2's DTensor, FSDP1's flat
views, a TP split) orthogonalized alone gives another update, silently. So each matrix gets an owner
among the ranks holding its pieces (balanced by size, the same choice on every rank):

1. every rank computes its pieces' update (fp32, elementwise) and casts it to bf16, which is what
   torch's Newton-Schulz does first (`grad.bfloat16()`): the cast per piece is the cast of the whole;
2. one all-to-all per process group sends each piece to its matrix's owner;
3. each owner assembles its matrices and runs torch's own `_zeropower_via_newtonschulz` on each;
4. one all-to-all sends each rank its pieces of the result (bf16, as torch adds it);
5. every rank applies the decay and the add with `_adjust_lr` of the whole matrix's shape.

A rank sends and receives its own pieces plus, as owner, 1/N of the matrices: 2 bytes per element
each way, two collectives per group and step, no host read. Where a member's matrix is whole on
every rank (one process; XLA SPMD's global view), its step is torch's own.

`Layout`: where one rank's elements sit in the whole matrix, for every rank of the group that holds
its pieces (parallel/engine/model/optim/layouts.py reads it off a DTensor; a backend with its own
sharding gives its own, backends/*/)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

Index = slice | torch.Tensor  # positions along one dimension: a run, or listed


@dataclass(frozen=True)
class Piece:
    """One rank's elements of a matrix, row-major: a block (rows x cols) or a flat run."""

    rows: Index | None = None
    cols: Index | None = None
    flat: slice | None = None
    numel: int = 0

    def put(self, whole: torch.Tensor, values: torch.Tensor) -> None:
        if self.flat is not None:
            whole.view(-1)[self.flat] = values
        else:
            whole[self._where()] = values.view(self._size(whole))

    def take(self, whole: torch.Tensor) -> torch.Tensor:
        if self.flat is not None:
            return whole.view(-1)[self.flat]
        return whole[self._where()].reshape(-1)

    def _where(self):
        if isinstance(self.rows, slice) or isinstance(self.cols, slice):
            return self.rows, self.cols  # basic indexing on one axis at least: a view's shape
        return self.rows[:, None], self.cols[None, :]

    def _size(self, whole: torch.Tensor) -> tuple[int, int]:
        return tuple(len(range(*i.indices(n))) if isinstance(i, slice) else len(i)
                     for i, n in zip((self.rows, self.cols), whole.shape))


@dataclass
class Layout:
    """A matrix sharded over `group`: its whole shape, each group rank's piece, this rank's index,
    and where this rank's piece sits in the tensor the optimizer holds (`local`: a run of its
    flattened elements; None: the whole tensor), for tensors holding several matrices (ZeRO's flat
    partitions)."""

    shape: tuple[int, int]
    group: object
    pieces: list[Piece]
    me: int
    local: slice | None = None
    owner: int = -1  # set by MuonStep: the group rank that orthogonalizes it

    @property
    def held(self) -> int:
        return self.pieces[self.me].numel


class MuonStep:
    """Replaces one torch.optim.Muon's step (`muon.step`): `layouts` maps id(tensor) to the
    Layouts of the matrices it holds pieces of, absent where the tensor is one whole matrix here.
    Every rank of a group lists the same matrices in the same order (empty pieces included), so
    the owners and the exchanges' sizes agree without a word between them."""

    def __init__(self, muon: torch.optim.Optimizer, layouts: dict[int, list[Layout]]):
        self.muon, self.layouts = muon, layouts
        self._balance()

    def _balance(self) -> None:
        """Owners: the largest matrices first, each to the least-loaded rank holding a piece of it
        (a rank with an empty piece never owns: it may not know whether the matrix has a gradient)."""
        load: dict[tuple, int] = {}
        every = [m for ms in self.layouts.values() for m in ms]
        for layout in sorted(every, key=lambda m: -m.shape[0] * m.shape[1]):
            ranks = [r for r, p in enumerate(layout.pieces) if p.numel]
            key = lambda r: (load.get((id(layout.group), r), 0), r)  # noqa: E731
            layout.owner = min(ranks, key=key)
            load[(id(layout.group), layout.owner)] = key(layout.owner)[0] + \
                layout.shape[0] * layout.shape[1]

    @torch.no_grad()
    def __call__(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every process group this call's tensors have pieces in, work or none: every rank of a
        # group then makes its two exchanges, whichever matrices had a gradient here
        pending: dict[int, tuple[object, Layout, torch.device, list]] = {}
        for group in self.muon.param_groups:
            for p in group["params"]:
                mine = self.layouts.get(id(p))
                for layout in mine or ():
                    pending.setdefault(id(layout.group), (layout.group, layout, _local(p).device,
                                                          []))
                if p.grad is None and not (mine and not any(m.held for m in mine)):
                    continue  # torch skips a parameter without a gradient (every holder agrees)
                update = self._update(p, group)
                if mine is None:  # whole here: torch's own orthogonalization
                    whole = _zeropower_via_newtonschulz(update, group["ns_coefficients"],
                                                        group["ns_steps"], group["eps"])
                    self._apply(_local(p), group, whole, tuple(p.shape))
                    continue
                for layout in mine:
                    piece = _run(update, layout.local) if layout.held else None
                    pending[id(layout.group)][3].append((p, group, layout, piece))
        for process_group, any_layout, device, work in pending.values():
            results = _orthogonalize(process_group, len(any_layout.pieces), any_layout.me, device,
                                     work)
            for (p, group, layout, _), result in zip(work, results):
                if result is not None:
                    self._apply(_run(_local(p), layout.local), group, result, layout.shape)
        return loss

    def _update(self, p, group) -> torch.Tensor | None:
        """torch's momentum and Nesterov blend on this rank's elements (its `_single_tensor_muon`)."""
        if p.grad is None:  # no element here
            return None
        state = self.muon.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    @staticmethod
    def _apply(local: torch.Tensor, group, result: torch.Tensor, shape) -> None:
        lr = _to_scalar(group["lr"])
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(result.view_as(local), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))


def _orthogonalize(process_group, size: int, me: int, device,
                   work: list) -> list[torch.Tensor | None]:
    """Gather each matrix at its owner, orthogonalize it there, send each rank its pieces back
    (`size` ranks, this one `me`). `work`: (tensor, hyper-parameters, Layout, this rank's piece of
    the update or None), maybe empty: the exchanges are made anyway."""
    sends: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for _, _, layout, piece in work:
        if piece is not None:
            sends[layout.owner].append(piece.reshape(-1).bfloat16())
    owned = [(group, layout) for _, group, layout, _ in work if layout.owner == me]
    received = _exchange(sends, [sum(m.pieces[r].numel for _, m in owned) for r in range(size)],
                         process_group, device)
    back: list[list[torch.Tensor]] = [[] for _ in range(size)]
    cursor = [0] * size
    for group, layout in owned:
        whole = torch.empty(layout.shape, dtype=torch.bfloat16, device=device)
        for r, piece in enumerate(layout.pieces):
            piece.put(whole, received[r][cursor[r]:cursor[r] + piece.numel])
            cursor[r] += piece.numel
        whole = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"],
                                            group["eps"]).contiguous()
        for r, piece in enumerate(layout.pieces):
            if piece.numel:
                back[r].append(piece.take(whole))
    from_owner = [0] * size  # one pass over the work, not one per rank (thousands of them)
    for _, _, layout, _ in work:
        from_owner[layout.owner] += layout.held
    returned = _exchange(back, from_owner, process_group, device)
    out, cursor = [], [0] * size
    for _, _, layout, _ in work:
        r, n = layout.owner, layout.held
        out.append(returned[r][cursor[r]:cursor[r] + n] if n else None)
        cursor[r] += n
    return out


def _run(t: torch.Tensor, local: slice | None) -> torch.Tensor:
    """A matrix's elements in the tensor `t` (a view: updates land in `t`)."""
    return t if local is None else t.view(-1)[local]


def _exchange(sends: list[list[torch.Tensor]], sizes: list[int], group,
              device) -> list[torch.Tensor]:
    """One all-to-all: rank r gets sends[r] concatenated; returns what each rank sent here, split
    by `sizes` (known on both sides: the layouts are every rank's). A group of one sends nothing."""
    flat = [torch.cat(s) if s else torch.empty(0, dtype=torch.bfloat16, device=device)
            for s in sends]
    if len(flat) == 1:
        return flat
    out = torch.empty(sum(sizes), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(out, torch.cat(flat), sizes, [t.numel() for t in flat], group=group)
    return list(out.split(sizes))


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


class MuonRefused(ValueError):
    """torch.optim.Muon over parameters whose whole matrices this backend cannot give it."""


def adopt_muon(optimizer: torch.optim.Optimizer, sharded, shapes: dict[str, tuple],
               layout_of) -> int:
    """Give every torch.optim.Muon among `optimizer`'s members a MuonStep over its matrices'
    layouts (`layout_of(param, name, built shape)`: a Layout, None where whole here, or raises
    MuonRefused). `sharded`: each trained tensor with the original names it holds. Returns how many
    Muon members it adopted."""
    from parallel.engine.model.optim.several import members

    names = {id(t): held for t, held in sharded}
    adopted = 0
    for member in members(optimizer):
        if not isinstance(member, torch.optim.Muon):
            continue
        layouts = {}
        for group in member.param_groups:
            for p in group["params"]:
                held = names.get(id(p), ["?"])
                if len(held) != 1:
                    raise MuonRefused(
                        f"optimizer: torch.optim.Muon holds one flat tensor of {len(held)} "
                        f"parameters ({held[:3]}...): it orthogonalizes matrices one by one; "
                        "keep one tensor per parameter (fsdp.use_orig_params: true, "
                        "xla.flatten_parameters: false)")
                layout = layout_of(p, held[0], shapes[held[0]])
                if layout is not None:
                    layouts[id(p)] = [layout]
        replace_step(member, MuonStep(member, layouts))
        adopted += 1
    return adopted


def replace_step(member: torch.optim.Optimizer, runner: MuonStep) -> None:
    """`member.step` runs `runner`, as a bound method (an LR scheduler re-wraps `step.__func__`)."""
    def step(self, closure=None):
        return runner(closure)
    member.step = types.MethodType(step, member)
