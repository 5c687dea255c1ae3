"""The user's own state in checkpoints: objects with `state_dict()` / `load_state_dict()` (an EMA of
the weights, a stateful sampler, metric accumulators) registered with the engine, saved with every
checkpoint and restored by `load`, as Accelerate's `register_for_checkpointing` does.

`shared` (default): one copy, written by the main rank and read by every rank (an object every rank
holds alike). `per_rank`: each rank writes its own, read back by the same rank; a resume on another
world size has other ranks, and is refused naming the object (there is no rule to split or merge
what a rank held). The files are torch.save'd plain data, read back as data (weights_only: tensors,
containers, numbers, strings), verified by the manifest like every file, and independent of the
backend: a checkpoint written by one backend restores them on another.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass
class Registered:
    obj: object
    per_rank: bool


class UserState:
    def __init__(self):
        self.objects: dict[str, Registered] = {}

    def register(self, obj, name: str | None = None, per_rank: bool = False) -> str:
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise TypeError(f"register_for_checkpointing: {type(obj).__name__} has no "
                                f"{method}(); give it state_dict() and load_state_dict()")
        name = name or f"state{len(self.objects)}"
        if not NAME.fullmatch(name) or name in self.objects:
            raise ValueError(f"register_for_checkpointing: name {name!r} is "
                             f"{'taken' if name in self.objects else 'not a plain file name'}; "
                             "use letters, digits, '_', '.', '-', unique per engine")
        self.objects[name] = Registered(obj, per_rank)
        return name

    def files(self, rank: int, is_main: bool) -> dict:
        """name -> a host copy of the state (taken now: the next step changes the object)."""
        out = {}
        for name, reg in self.objects.items():
            if reg.per_rank:
                out[f"user/{name}/rank{rank}.pt"] = host_copy(reg.obj.state_dict(), name)
            elif is_main:
                out[f"user/{name}.pt"] = host_copy(reg.obj.state_dict(), name)
        return out

    def kinds(self) -> dict:
        """For the manifest: name -> "per_rank" | "shared"."""
        return {n: "per_rank" if r.per_rank else "shared" for n, r in self.objects.items()}

    def check(self, path: Path, manifest: dict, world_size: int) -> dict:
        """Before anything is loaded: the manifest's table, and what cannot be restored here."""
        saved = manifest.get("user_state", {})  # its shape checked by read_manifest (schemas.py)
        for name, reg in self.objects.items():
            kind, now = saved.get(name), "per_rank" if reg.per_rank else "shared"
            if kind is not None and kind != now:
                raise ValueError(f"registered state {name!r} was saved {kind} and is registered "
                                 f"{now} now; register it as it was saved")
            if kind == "per_rank" and manifest.get("world_size") != world_size:
                raise ValueError(f"registered state {name!r} is per rank, written by "
                                 f"{manifest.get('world_size')} ranks, and this run has "
                                 f"{world_size}: each rank's copy has no rank to go to. Resume on "
                                 f"{manifest.get('world_size')} ranks, or register it shared")
        return saved

    def load(self, saved: dict, rank: int, read: Callable, say: Callable[[str], None]) -> None:
        """Restore every registered object (`saved`: check()'s table); `read(name, writer, what)`
        loads one file of the checkpoint as data (contents.py: listed by its writer rank's table)."""
        for name, reg in self.objects.items():
            if name not in saved:
                say(f"registered state {name!r} is not in the checkpoint (it has "
                    f"{sorted(saved)}): it keeps its current state")
                continue
            file = f"user/{name}/rank{rank}.pt" if reg.per_rank else f"user/{name}.pt"
            reg.obj.load_state_dict(read(file, rank if reg.per_rank else 0,
                                         f"registered state {name!r}"))
        dropped = sorted(set(saved) - set(self.objects))
        if dropped:
            say(f"the checkpoint's registered state(s) {dropped} were not registered in this run; "
                "they are not restored")


def host_copy(tree, name: str):
    """A CPU copy of every tensor in a nested state (an async save writes it later)."""
    if isinstance(tree, dict):
        return {k: host_copy(v, name) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(host_copy(v, name) for v in tree)
    if isinstance(tree, torch.Tensor):
        if type(tree) is not torch.Tensor and not isinstance(tree, torch.nn.Parameter):
            raise TypeError(f"registered state {name!r} holds a {type(tree).__name__} (a sharded "
                            "tensor): keep plain tensors in it (this rank's local part, with "
                            "per_rank=True, or the full tensor)")
        return tree.detach().to("cpu", copy=True)
    return tree
