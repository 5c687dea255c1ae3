"""Checkpointing half of the Engine: save / load in the portable format (docs/checkpoint-format.md),
periodic saves into `checkpoint.dir`, and `resume: auto` after a restart."""

from __future__ import annotations

import contextlib
import gc
from abc import abstractmethod
from pathlib import Path

import torch

from parallel.engine import dist as pdist
from parallel.engine.hang import PROGRESS
from parallel.checkpoint.background import BackgroundSaver, staging
from parallel.checkpoint.directory import (
    LATEST,
    WRITTEN,
    begin_checkpoint,
    finish_checkpoint,
    library_versions,
    publish,
    resolve,
    save_rank_file,
    record_written,
    Verification,
)
from parallel.checkpoint.hf import hf_config_json, peft_config_json
from parallel.checkpoint.portable import save_state
from parallel.checkpoint.safe import NUMPY_ARRAY, torch_load


@contextlib.contextmanager
def paused_gc():
    """Python's cyclic collector off for the length of a save or load: DCP's plans and the state's
    containers allocate enough objects to trigger full collections in the middle (measured: a
    56M-parameter FSDP2 load took 0.15 s or, when a collection fell inside it, 0.32 s; torchtitan
    runs with the collector off and collects between steps). Anything cyclic is collected at the next
    automatic collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class CheckpointMixin:
    """Needs from the Engine: spec, rank, world_size, is_main, step, model, scheduler, loaders,
    barrier(), _check_finite(), and the two backend hooks below."""

    background_save = True  # False where the state cannot be staged off the device (XLA)

    @property
    def _saver(self) -> BackgroundSaver:
        if "_background_saver" not in self.__dict__:
            self._background_saver = BackgroundSaver()
        return self._background_saver

    def save(self, path, async_save: bool | None = None) -> Path:
        with paused_gc():
            return self._save(path, async_save)

    def _save(self, path, async_save: bool | None) -> Path:
        """Write model, optimizer, scheduler, step, RNG and data position under `path`, atomically,
        then point `latest` beside it at `path` and apply `checkpoint.keep_last`. With
        `checkpoint.async_save` (or `async_save=True`), return once this rank's state is copied to
        host memory; the files are written and published in the background."""
        self._check_finite(wait=True)  # never a checkpoint of parameters a NaN step has updated
        self._saver.wait()  # one write in flight: the previous one is published (or raises) first
        background_write = self.spec.checkpoint.async_save if async_save is None else async_save
        if background_write and not self.background_save:
            raise ValueError(f"backend {self.name!r} cannot save in the background "
                             "(checkpoint.async_save); save synchronously")
        PROGRESS.at(self.step, "done, saving")
        path, hf_config = Path(path), hf_config_json(self.model)
        peft_config = peft_config_json(self.model)  # a LoRA run: what `export --to peft` needs
        group = self._saver.ensure_group() if background_write else None
        tmp = begin_checkpoint(path, self.rank, group)
        rng, trainer = pdist.rng_state(), (self.trainer_state() if self.is_main else None)
        meta = {"backend": self.name, "world_size": self.world_size, "step": self.step,
                "state_dict": self.spec.state_dict, "spec": self.spec.model_dump(mode="json"),
                "versions": library_versions()}

        def write_small_files() -> None:
            save_rank_file(rng, tmp, "rng", self.rank)
            if self.is_main:
                torch.save(trainer, tmp / "trainer.pt")
                record_written(tmp / "trainer.pt")
                for name, text in (("hf_config.json", hf_config), ("peft_config.json", peft_config)):
                    if text is not None:  # lets `polyshard ckpt export --to hf|peft` stand alone
                        (tmp / name).write_text(text)
                        record_written(tmp / name)

        def publish_all() -> None:
            finish_checkpoint(path, tmp, self.rank, meta, group=group)
            if self.is_main:
                publish(path, self.spec.checkpoint.keep_last, self.spec.checkpoint.dir and
                        Path(self.spec.checkpoint.dir))

        if not background_write:
            WRITTEN.clear()
            self._save_model_optim(tmp)
            write_small_files()
            publish_all()
            self.barrier()
        else:
            with staging(self._saver.pinned) as queued:  # copies this rank's state; no file yet
                self._save_model_optim(tmp)

            def write_in_background() -> None:
                WRITTEN.clear()
                for state, where, planner, collective in queued:
                    save_state(state, where, planner, collective, process_group=group)
                write_small_files()
                publish_all()

            self._saver.submit(write_in_background)
        PROGRESS.at(self.step, "done")
        return path

    def wait_for_save(self) -> None:
        """Block until an async save in flight is published (its error, if any, is raised here)."""
        self._saver.wait()

    def load(self, path, trust: bool = False) -> dict:
        with paused_gc():
            return self._load(path, trust)

    def _load(self, path, trust: bool) -> dict:
        """Verify `path` (manifest, sizes, sha256), then restore everything `save` wrote, whichever
        backend and world size wrote it. `path` may be a directory of checkpoints: its `latest`.
        Every file is read as data: a crafted pickle is refused naming the file and what it asked
        for (docs/security.md); `trust=True` unpickles fully, for files whose origin you trust."""
        self._saver.wait()  # a checkpoint still being written is published before anything is read
        path = resolve(path)
        # Each rank checks the digests of its share of the files on a thread while the state is
        # read (verifying first doubled the time of a load: issue #27). A damaged file fails
        # load() on every rank, naming it; the model then holds what was read and must not be used.
        verifying = Verification(path)
        manifest = verifying.manifest
        try:
            self._load_model_optim(path, manifest)
        except BaseException:
            verifying.agree()  # a damaged file explains the failure better than the reader's error
            raise
        verifying.agree()
        trainer = torch_load(path / "trainer.pt", "the trainer state", trust=trust)
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        same_world = manifest["world_size"] == self.world_size and rng_file.is_file()
        # format <= 2 kept numpy's RNG keys as an ndarray: those few numpy classes are allowed
        rng = torch_load(rng_file, "an RNG state", NUMPY_ARRAY, trust) if same_world else None
        self.load_trainer_state(trainer)
        if rng is not None:  # another world size has other ranks: each keeps its seeded generator
            pdist.set_rng_state(rng)
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
        if not every or not root or self.step % every or self._preempted is not None:
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

