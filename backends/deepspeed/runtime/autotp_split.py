"""What DeepSpeed AutoTP did to a model (`topology.tp` on DeepSpeed; the plan itself: autotp.py): where
each split parameter's shard sits in the whole tensor, for checkpoints and the gradient norm.
deepspeed is imported only when an engine builds a `Split`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.checkpoint.state.chunks import Box, FlatRange

META = "ds_autotp_universal_checkpoint_meta"  # deepspeed.checkpoint.constants.DS_AUTOTP_UC_META


class Split:
    """What AutoTP did to a model: this rank's place in its TP group and, per parameter name it
    split, where the local shard sits in the whole tensor (AutoTP's own per-parameter record:
    partition_dim, logical_shape, partition_sizes). Checkpoints write the shards as blocks of the
    whole tensors, so a TP checkpoint is the same portable state as any other."""

    def __init__(self, module, names: dict[int, str]):
        from deepspeed.utils import groups

        self.group = groups.get_tensor_model_parallel_group()
        self.rank = dist.get_rank(group=self.group)
        self.boxes = {names[id(p)]: box for p in module.parameters()
                      if (box := self._box(p)) is not None}
        self.split_ids = {id(p) for p in module.parameters() if names[id(p)] in self.boxes}

    def _box(self, p) -> Box | None:
        meta = getattr(p, META, None)
        if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
            return None
        if meta.get("sub_param_shape") is not None:  # fused projections: pieces, not one block
            raise RuntimeError(f"AutoTP split a parameter of shape {meta['logical_shape']} into "
                               "sub-parameters, which polyshard's checkpoints cannot place; "
                               "split unfused projections (topology.tp_plan)")
        return Box.split(meta["logical_shape"], meta["partition_dim"], meta["partition_sizes"],
                         self.rank)

    def check(self, module, expected: dict[str, tuple], names: dict[int, str]) -> None:
        """Each parameter's shape on this rank is the plan's (tp_plan.local_shapes): AutoTP split
        exactly what FSDP2 and XLA split, evenly."""
        shape = lambda p: tuple(getattr(p, "ds_shape", p.shape))  # noqa: E731 (ZeRO-3: before
        wrong = {names[id(p)]: (shape(p), expected.get(names[id(p)]))  # its own partitioning)
                 for p in module.parameters() if expected.get(names[id(p)]) != shape(p)}
        if wrong:
            raise RuntimeError(f"AutoTP's split differs from the plan's (name: (AutoTP's, plan's "
                               f"shape on this rank)): {dict(list(wrong.items())[:4])}")

    def piece(self, name: str, local: torch.Tensor):
        """`local` (this rank's tensor of parameter `name`, or of an optimizer entry shaped like it)
        as the block of the whole tensor it is; a tensor AutoTP did not split as it is."""
        box = self.boxes.get(name)
        if box is None or local.dim() == 0:
            return local
        return FlatRange(local.detach().reshape(-1), 0, local.shape, box)

    def whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from the TP group's shards (collective over the group, every rank in
        the same order); a tensor AutoTP did not split as it is."""
        box = self.boxes.get(name)
        if box is None or local.dim() == 0:
            return local
        dim = next(d for d, (a, b) in enumerate(zip(box.full, local.shape)) if a != b)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def state(self, state: dict, convert) -> dict:
        """{"model": {name: t}, "optim": {"state": {name: {key: t}}, ...}} with each tensor
        converted by `convert(name, t)` (piece or whole)."""
        out = {"model": {k: convert(k, v) for k, v in state["model"].items()}}
        if "optim" in state:
            out["optim"] = {**state["optim"], "state": {
                k: {e: convert(k, v) if torch.is_tensor(v) else v for e, v in entries.items()}
                for k, entries in state["optim"]["state"].items()}}
        return out

    def grad_norm(self, params) -> torch.Tensor:
        """The global gradient norm where the split parameters' gradients are this rank's shards:
        their squares summed over the TP group (one scalar all-reduce), the rest counted once."""
        split, whole = [], []
        for p in params:
            if p.grad is not None:
                (split if id(p) in self.split_ids else whole).append(p.grad)
        device = (split or whole)[0].device
        squares = torch.stack([torch.nn.utils.get_total_norm(g, 2.0).to(device) ** 2 if g else
                               torch.zeros((), device=device) for g in (split, whole)])
        dist.all_reduce(squares[0:1], group=self.group)
        return squares.sum().sqrt()
