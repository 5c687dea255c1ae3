"""Parameters a step does not use: mixture-of-experts layers, where each rank's tokens reach a few
experts and different ranks reach different ones.

One process on the global batch gives every routed expert its gradient and leaves the others without
one (`grad` None), which torch optimizers skip: no weight decay, no momentum, no step count. Split over
ranks, an expert used on rank 0 only has a gradient there and none on rank 1, and the backends break
in three ways (measured on HF Mixtral, 16 experts top-1, 2 ranks): FSDP2 and ZeRO-2 reduce different
lists of gradients on different ranks (gloo: "collective mismatch"; NCCL: a hang or wrong sums); ZeRO-3
gathers different experts on different ranks; the flat-parameter backends give the unused a zero
gradient and update it.

The convention this reads is Hugging Face's (Mixtral, Qwen2-MoE, OLMoE, ...): a block holding an
`experts` ModuleList that calls only the experts its tokens were routed to. Two things are done:

- Every expert runs every forward, in index order, on every rank: an expert the block did not call
  is called on an empty input (no rows: a few empty kernels) just before the next one it does call,
  or at the block's end, and its empty output is added to that call's output (an exact zero). So every
  rank's backward produces a gradient for every expert, in the same order: the lists reduced and the
  parameters gathered agree across ranks, and a zero gradient adds nothing to a sum.
- Which experts ran for real is known on the host when they run (the block itself read its routing
  to the host to call them). Before the update, one small sum over ranks says which experts no rank
  used; their gradients are dropped, so the optimizer skips them exactly as one process does. Backends
  whose optimizer steps flat tensors (FSDP1 without use_orig_params, XLA FSDP v1, DeepSpeed ZeRO) cannot
  skip one parameter: they say so at prepare, naming the experts (docs/moe.md has the measured
  difference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from parallel.kits.names import clean_name


_PROBING = [0]  # pipeline metadata probes running now (`probing`)


def a_step_forward(module: nn.Module) -> bool:
    """Whether `module` runs in a training step's own forward: not evaluation or generation, not a
    pipeline stage's metadata probe (torch 2.9 ran it without grad; 2.15 runs a forward and a
    backward with grad at a schedule's first step: `probing` marks it) and not activation
    checkpointing's recomputation (inside the backward)."""
    return (module.training and torch.is_grad_enabled() and not _PROBING[0]
            and torch._C._current_graph_task_id() == -1)


@contextlib.contextmanager
def probing():
    """Around a pipeline stage's metadata probe: no forward inside is a step's own."""
    _PROBING[0] += 1
    try:
        yield
    finally:
        _PROBING[0] -= 1


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Blocks that route tokens to some of their `experts` (a ModuleList), by clean name."""
    return [(clean_name(name), m) for name, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), nn.ModuleList)]


def fused_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Blocks whose `experts` hold every expert in fused 3-D parameters, as transformers 5 builds
    Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3 (`experts.gate_up_proj` [E, 2F, D],
    `experts.down_proj` [E, D, F]). One tensor per projection gets a gradient every step, its rows of
    unrouted experts zero, on one process as on every rank: each backend steps it as one process
    does, and an expert no token reached is updated (weight decay, momentum) on both."""
    return [(clean_name(name), m) for name, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), nn.Module)
            and not isinstance(m.experts, nn.ModuleList)
            and any(p.dim() == 3 for p in m.experts.parameters(recurse=False))]


def router_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Mixture-of-experts blocks of either layout (a ModuleList of experts, or fused), whose router
    is the `gate` module beside them."""
    return moe_blocks(model) or fused_blocks(model)


class Experts:
    """The experts of a model as built, their use on this rank, and the hooks that touch them."""

    def __init__(self, model: nn.Module, touch: bool):
        self.blocks = moe_blocks(model)
        self.names: list[str] = []  # one per expert, "model.layers.0.mlp.experts.3"
        self.params: list[list[str]] = []  # each expert's parameter names (ep drops the others)
        self.used: list[bool] = []  # this rank, this step
        self._touching = False
        self._handles = []
        for block_name, block in self.blocks:
            first = len(self.names)
            self.names += [f"{block_name}.experts.{i}" for i in range(len(block.experts))]
            self.params += [[f"{block_name}.experts.{i}.{n}" for n, _ in e.named_parameters()]
                            for i, e in enumerate(block.experts)]
            self.used += [False] * len(block.experts)
            self._hook(block, first, touch)

    def __bool__(self) -> bool:
        return bool(self.names)

    def summary(self) -> str:
        """The experts by pattern: 'model.layers.{0..1}.mlp.experts.{0..15} (32 modules)'."""
        name, block = self.blocks[0]
        return (f"{len(self.names)} experts in {len(self.blocks)} blocks such as {name}.experts."
                f"{{0..{len(block.experts) - 1}}} ({type(block).__name__})")

    def param_names(self, experts: list[int]) -> list[str]:
        return [name for i in experts for name in self.params[i]]

    def drop_unused(self, trained, device, group, summed: list[float] | None = None) -> None:
        """Experts no rank used this step got zero gradients: drop them (`.grad = None`), so the
        optimizer skips them as one process does. `trained`: (tensor, [its original name]) of every
        parameter the optimizer steps; `group`: the ranks whose routing counts (every rank: an
        expert any of them used keeps its gradient). `summed`: `use_of_step` already summed over
        `group`, on the host (the engine packs it into the step's loss reduction and reads both in
        one read, which is the step's loss read too); else one small sum over ranks and one host
        read here."""
        from parallel import dist as pdist

        if summed is None:
            summed = pdist.PendingSum(self.use_of_step(device), group)().tolist()
        unused = [i for i, n in enumerate(summed) if n < 0.5]
        if unused:
            names = set(self.param_names(unused))
            for p, (name,) in trained:
                if name in names:
                    p.grad = None

    def use_of_step(self, device) -> torch.Tensor:
        """This rank's use of each expert during the step that just ran (1 or 0), for the sum over
        ranks; the record starts again."""
        return torch.tensor(self.step_done(), dtype=torch.float32, device=device)

    def step_done(self) -> list[bool]:
        """This rank's use during the step that just ran; the record starts again."""
        used, self.used = self.used, [False] * len(self.used)
        return used

    def _hook(self, block: nn.Module, first: int, touch: bool) -> None:
        cursor = {"next": 0, "input": None}  # the next expert index the block has not run

        def block_pre(module, args, kwargs):
            cursor["next"] = 0
            hidden = args[0] if args else next(iter(kwargs.values()))
            cursor["input"] = hidden.new_empty(0, hidden.shape[-1])
            return None

        def expert_pre(index: int) -> Callable:
            def hook(module, args):
                if self._touching:
                    return None
                # a step's use only: an evaluation between steps marked its experts used, and the
                # next step then kept their zero gradients and updated them (measured: 5e-5 off
                # one process at the step after); no rows: ep's dispatch runs every held expert
                if args[0].shape[0] and a_step_forward(module):
                    self.used[first + index] = True
                cursor["pending"] = self._run_empty(block, cursor, index) if touch else None
                return None
            return hook

        def expert_post(module, args, output):
            pending = cursor.pop("pending", None)
            return output if pending is None or self._touching else output + pending

        def block_post(module, args, kwargs, output):
            tail = self._run_empty(block, cursor, len(block.experts)) if touch else None
            if tail is None:
                return output
            if isinstance(output, torch.Tensor):
                return output + tail
            return (output[0] + tail, *output[1:])  # (hidden states, router logits)

        self._handles.append(block.register_forward_pre_hook(block_pre, with_kwargs=True))
        self._handles.append(block.register_forward_hook(block_post, with_kwargs=True))
        for index, expert in enumerate(block.experts):
            self._handles.append(expert.register_forward_pre_hook(expert_pre(index)))
            self._handles.append(expert.register_forward_hook(expert_post))

    def _run_empty(self, block: nn.Module, cursor: dict, upto: int) -> torch.Tensor | None:
        """Run experts cursor..upto-1 (those the block skipped) on no rows; their summed empty
        outputs, an exact zero that carries their gradients (zeros) into the backward."""
        start, cursor["next"] = cursor["next"], upto + 1
        if start >= upto or cursor["input"] is None:
            return None
        self._touching = True
        try:
            return sum(block.experts[j](cursor["input"]).sum() for j in range(start, upto))
        finally:
            self._touching = False
