"""Checkpointing half of the Engine: save / load in the portable format (docs/checkpoint-format.md),
periodic saves into `checkpoint.dir`, and `resume: auto` after a restart."""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

import torch

from parallel.engine import dist as pdist
from parallel.checkpoint.directory import (
    LATEST,
    hf_config_json,
    library_versions,
    publish,
    resolve,
    save_rank_file,
    verify_on_rank0,
    write_checkpoint,
)


class CheckpointMixin:
    """Needs from the Engine: spec, rank, world_size, is_main, step, model, scheduler, loaders,
    barrier(), and the two backend hooks below."""

    def save(self, path) -> Path:
        """Write model, optimizer, scheduler, step, RNG and data position under `path`, atomically,
        then point `latest` beside it at `path` and apply `checkpoint.keep_last`."""
        hf_config = hf_config_json(self.model)

        def write(tmp: Path) -> None:
            self._save_model_optim(tmp)
            save_rank_file(pdist.rng_state(), tmp, "rng", self.rank)
            if self.is_main:
                torch.save(self.trainer_state(), tmp / "trainer.pt")
                if hf_config is not None:  # lets `polyshard ckpt export --to hf` stand alone
                    (tmp / "hf_config.json").write_text(hf_config)

        meta = {"backend": self.name, "world_size": self.world_size, "step": self.step,
                "state_dict": self.spec.state_dict, "spec": self.spec.model_dump(mode="json"),
                "versions": library_versions()}
        path = write_checkpoint(path, self.rank, write, meta)
        if self.is_main:
            publish(path, self.spec.checkpoint.keep_last)
        self.barrier()
        return path

    def load(self, path) -> dict:
        """Verify `path` (manifest, sizes, sha256), then restore everything `save` wrote, whichever
        backend and world size wrote it. `path` may be a directory of checkpoints: its `latest`."""
        path = resolve(path)
        manifest = verify_on_rank0(path)
        self._load_model_optim(path, manifest)
        self.load_trainer_state(torch.load(path / "trainer.pt", weights_only=False))
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        if manifest["world_size"] == self.world_size and rng_file.is_file():
            # Another world size has other ranks: each keeps its seeded generator instead.
            pdist.set_rng_state(torch.load(rng_file, weights_only=False))
        return manifest

    @abstractmethod
    def _save_model_optim(self, tmp: Path) -> None:
        """Write this rank's part of the model and optimizer state into `tmp`."""

    @abstractmethod
    def _load_model_optim(self, path: Path, manifest: dict) -> None:
        """Restore model and optimizer state from a verified checkpoint."""

    def maybe_save(self) -> Path | None:
        """Save into checkpoint.dir/step-NNNNNNNN when checkpoint.every divides the step."""
        every, root = self.spec.checkpoint.every, self.spec.checkpoint.dir
        if not every or not root or self.step % every:
            return None
        return self.save(Path(root) / f"step-{self.step:08d}")

    def resume(self) -> dict | None:
        """With `checkpoint.resume: auto`, load checkpoint.dir's latest complete checkpoint if there
        is one (after a crash or an elastic restart) and return its manifest; else None. Call it
        after prepare() and after creating the data loaders."""
        root = self.spec.checkpoint.dir
        if self.spec.checkpoint.resume != "auto" or not root or not (Path(root) / LATEST).is_file():
            return None
        return self.load(root)

    def trainer_state(self) -> dict:
        return {"step": self.step,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "loaders": [loader.state_dict() for loader in self.loaders]}

    def load_trainer_state(self, state: dict) -> None:
        self.step = state["step"]
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["loaders"] and len(state["loaders"]) != len(self.loaders):
            raise ValueError(f"checkpoint recorded {len(state['loaders'])} data loaders, this run "
                             f"created {len(self.loaders)}; create loaders before load()")
        for loader, loader_state in zip(self.loaders, state["loaders"]):
            loader.load_state_dict(loader_state)

