"""The engine's checkpointing part: save / load in the portable format (docs/checkpoint-format.md),
periodic saves into `checkpoint.dir`, and `resume: auto` after a restart. It owns the background
saver; every file of a save goes through that save's `Sink` (parallel/checkpoint/state/sink.py)."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Protocol


from parallel import dist as pdist
from parallel.heap import paused_gc
from parallel.checkpoint.background.saver import BackgroundSaver, StagedSink
from parallel.checkpoint.format.directory import (
    begin_checkpoint,
    ensure_replaceable,
    fsync_files,
    library_versions,
    partial_path,
    remove_ours,
    resolve,
)
from parallel.checkpoint.background.finishing import PendingSave
from parallel.checkpoint.format.manifest import Verification
from parallel.checkpoint.hf.export import hf_config_json, peft_config_json
from parallel.checkpoint.format.contents import Contents
from parallel.checkpoint.format.safe import NUMPY_ARRAY
from parallel.checkpoint.format.schemas import TrainerState
from parallel.checkpoint.state.sink import Sink
from parallel.engine.state import pretrained
from parallel.engine.state.resuming import resume
from parallel.engine.state.shared_dir import check_shared


class Checkpointed(Protocol):
    """The checkpointer's port: what it reads of the engine it serves, all public. The backend's
    two hooks that write and read the model and optimizer are handed to it apart (Checkpointer)."""

    spec: object
    name: str
    rank: int
    world_size: int
    device: object  # where the start-up check's few numbers travel (shared_dir.py)
    is_main: bool
    step: int
    model: object
    background_save: bool  # False where the state cannot be staged off the device (XLA)
    user_state: object  # the user's registered objects (user_state.py)

    def trainer_state(self) -> dict: ...

    def say(self, message: str) -> None: ...

    def load_trainer_state(self, state: dict) -> None: ...

    def check_finite(self, wait: bool = False) -> None: ...

    def barrier(self) -> None: ...


class Checkpointer:
    def __init__(self, engine: Checkpointed, write: Callable[[Sink], None],
                 read: Callable[[Path, dict], None], progress, packages: tuple[str, ...] = ()):
        """`write(sink)`: this rank's part of the model and optimizer state through the save's sink;
        `read(path, manifest, weights_only=...)`: restore them (or the weights alone) from a
        verified checkpoint (the backend's hooks).
        `packages`: distributions whose versions the manifest records beside torch's."""
        self.engine, self.write, self.read, self.progress = engine, write, read, progress
        self.packages = packages
        ckpt = engine.spec.checkpoint  # one write in flight, on its own process (or thread)
        self.saver = BackgroundSaver(ckpt.async_writer, engine.spec.timeout_s)
        self.started_at = 0  # the step the job started from (a load's): hf_at_end
        self._versions: dict | None = None
        self.side = None  # save_pretrained's gloo group, where the job's cannot sum host tensors
        check_shared(ckpt.dir, engine.rank, engine.device)  # one directory for every rank

    @property
    def versions(self) -> dict:
        """What wrote this run's checkpoints, read once (package metadata: 7 ms a save)."""
        if self._versions is None:
            self._versions = library_versions(self.packages)
        return self._versions

    def save(self, path, async_save: bool | None = None) -> Path:
        with paused_gc():
            return self._save(Path(path), async_save)

    def save_pretrained(self, directory, tokenizer=None, max_shard_bytes: int | None = None,
                        durable: bool = False) -> Path:
        """Hugging Face format, every rank writing its share of the safetensors files (no rank
        holds the model): each rank writes its own pieces in place in the files (pretrained.py,
        hf_gather.py); a PEFT run's active adapter as PeftModel.save_pretrained writes it.
        `durable`: the weight files are fsynced."""
        e, out = self.engine, Path(directory)
        with paused_gc():
            self.saver.wait()
            pretrained.save(e, self.write, out, max_shard_bytes, durable, self._side_group)
            if tokenizer is not None and e.is_main:
                tokenizer.save_pretrained(str(out))  # the caller's own object
            e.barrier()
        return out

    def _side_group(self):
        """A gloo group for save_pretrained's counts where the job's group cannot sum host
        tensors (torch_xla's), made once, by every rank at its first save_pretrained."""
        if self.side is None:
            import torch.distributed as dist

            self.side = dist.new_group(backend="gloo")
        return self.side

    def _save(self, path: Path, async_save: bool | None) -> Path:
        """Write model, optimizer, scheduler, step, RNG and data position under `path`, atomically,
        then point `latest` beside it at `path` and apply `checkpoint.keep_last`. With
        `checkpoint.async_save` (or `async_save=True`), return once this rank's state is copied to
        host memory; the files are written and published in the background."""
        e, spec = self.engine, self.engine.spec
        e.check_finite(wait=True)  # never a checkpoint of parameters a NaN step has updated
        self.saver.wait()  # one write in flight: the previous one is published (or raises) first
        background = spec.checkpoint.async_save if async_save is None else async_save
        if background and not e.background_save:
            raise ValueError(f"backend {e.name!r} cannot save in the background "
                             "(checkpoint.async_save); save synchronously")
        self.progress.at(e.step, "done, saving")
        if background:  # the writer opens the directory; a path not ours is refused here, now
            ensure_replaceable(path)
            group, tmp = self.saver.ensure_group(), partial_path(path)
        else:
            group, tmp = None, begin_checkpoint(path, e.rank)
        threads = spec.checkpoint.write_threads
        # the next forward may change buffers (BatchNorm's statistics): copied now; parameters
        # and optimizer state change only at an optimizer step, which waits for their copies
        sink = StagedSink(tmp, self.saver.pinned, group, threads, now={
            b.data_ptr() for b in e.model.buffers()}) if background else Sink(tmp, group, threads)
        small = self._small_files(e)  # taken now: the next step changes them
        meta = {"backend": e.name, "world_size": e.world_size, "step": e.step,
                "user_state": e.user_state.kinds(),
                "state_dict": spec.state_dict, "spec": spec.model_dump(mode="json"),
                "versions": self.versions}
        keep, managed = spec.checkpoint.keep_last, spec.checkpoint.dir and Path(spec.checkpoint.dir)
        job = PendingSave(path, sink, small, meta, e.rank, e.is_main, keep, managed,
                          opened=not background)
        try:
            self.write(sink)  # staged: places this rank's state in host memory, no file yet
        except BaseException:
            sink.placed(wait=True)
            raise
        sink.placed()
        if background:
            self.saver.submit(job)
        else:
            job.run()
            e.barrier()
        self.progress.at(e.step, "done")
        return path

    @staticmethod
    def _small_files(e: Checkpointed) -> dict:
        """name -> object (torch.save) or text, of this rank: its RNG; the main rank's trainer state
        and the model's configs (they let `polyshard ckpt export --to hf|peft` stand alone)."""
        files = {f"rng/rank{e.rank}.pt": pdist.rng_state(), **e.user_state.files(e.rank, e.is_main)}
        if e.is_main:
            files["trainer.pt"] = e.trainer_state()
            configs = {"hf_config.json": hf_config_json(e.model),
                       "peft_config.json": peft_config_json(e.model)}  # a LoRA run's adapter config
            files.update({k: v for k, v in configs.items() if v is not None})
        return files

    def at_end(self) -> Path | None:
        """checkpoint.hf_at_end, at close after a job that trained: the weights in Hugging Face
        format as checkpoint.dir/hf-step-NNNNNNNN, written beside it and renamed into place by the
        main rank once every rank's files are durable (collective)."""
        e, ckpt = self.engine, self.engine.spec.checkpoint
        if not ckpt.hf_at_end or e.step <= self.started_at:
            return None
        out = Path(ckpt.dir) / f"hf-step-{e.step:08d}"
        if out.exists() or out.is_symlink():
            e.say(f"checkpoint.hf_at_end: {out} is there already (written at this step); kept")
            return out
        tmp = partial_path(out)
        if e.is_main:
            remove_ours(tmp)  # a crash's leftover, of the name only polyshard writes
            tmp.parent.mkdir(parents=True, exist_ok=True)
        e.barrier()
        self.save_pretrained(tmp, durable=True)  # ends in a barrier: every rank's files fsynced
        if e.is_main:
            fsync_files([tmp])
            tmp.rename(out)
            fsync_files([out.parent])
            e.say(f"checkpoint.hf_at_end: step {e.step}'s weights in Hugging Face format: {out}")
        e.barrier()
        return out

    def wait(self) -> None:
        """Block until an async save in flight is published (its error, if any, is raised here)."""
        self.saver.wait()

    def staged(self) -> None:
        """Block until an async save's copies have landed: before anything changes parameters or
        optimizer state (the engine's optimizer step). Overlapping the forward and backward
        between, as torchtitan's maybe_wait_for_staging before its optimizer step."""
        self.saver.staged()

    def load(self, path, trust: bool = False, weights_only: bool = False) -> dict:
        with paused_gc():
            return self._load(path, trust, weights_only)

    def _load(self, path, trust: bool, weights_only: bool) -> dict:
        """Verify `path` (manifest, sizes, digests), then restore everything `save` wrote, whichever
        backend and world size wrote it. `path` may be a directory of checkpoints: its `latest`.
        Every file is read as data: a crafted pickle is refused naming the file and what it asked
        for (docs/security.md); `trust=True` unpickles fully, for files whose origin you trust.
        `weights_only`: the model's weights and buffers alone; the optimizer, step, scheduler, RNG,
        data position and registered objects stay this run's (a fine-tune starting from a
        checkpoint, or one imported without optimizer state)."""
        e = self.engine
        self.saver.wait()  # a checkpoint still being written is published before anything is read
        path = resolve(path)
        # Each rank checks the digests of its share of the files on a thread while the state is
        # read (verifying first doubled the time of a load: issue #27). A damaged file fails
        # load() on every rank, naming it; the model then holds what was read and must not be used.
        verifying = Verification(path)
        manifest = verifying.manifest
        # refused before anything is read
        user = None if weights_only else e.user_state.check(path, manifest, e.world_size)
        try:
            self.read(path, manifest, weights_only=weights_only)
        except BaseException:
            verifying.agree()  # a damaged file explains the failure better than the reader's error
            raise
        verifying.agree()
        if weights_only:
            e.say(f"load: the weights of {path} (step {manifest.get('step')}); optimizer and step "
                  f"are this run's (step {e.step})")
            return manifest
        # the small files through the one reader: listed in their writer's table, no link, bounded,
        # parsed into their schema (contents.py)
        files = Contents(path, manifest)
        trainer = files.load("trainer.pt", 0, "the trainer state", TrainerState, trust=trust)
        rng_file = f"rng/rank{e.rank}.pt"
        same_world = manifest["world_size"] == e.world_size and files.has(rng_file, e.rank)
        # format <= 2 kept numpy's RNG keys as an ndarray: those few numpy classes are allowed
        rng = files.load(rng_file, e.rank, "an RNG state", allow=NUMPY_ARRAY,
                         trust=trust) if same_world else None
        e.load_trainer_state(trainer)
        self.started_at = e.step  # hf_at_end writes only after a step beyond it
        e.user_state.load(user, e.rank, lambda name, writer, what: files.load(
            name, writer, what, trust=trust), e.say)
        if rng is not None:  # another world size has other ranks: each keeps its seeded generator
            pdist.set_rng_state(rng)
        return manifest

    def maybe_save(self) -> Path | None:
        """Save into checkpoint.dir/step-NNNNNNNN when checkpoint.every divides the step."""
        e = self.engine
        every, root = e.spec.checkpoint.every, e.spec.checkpoint.dir
        if not every or not root or e.step % every:
            return None
        return self.save(Path(root) / f"step-{e.step:08d}")

    def resume(self) -> dict | None:
        """With `checkpoint.resume: auto | latest_valid`, load checkpoint.dir's latest complete
        checkpoint if there is one (after a crash or an elastic restart) and return its manifest;
        else None. What it did is said (resuming.py)."""
        ckpt = self.engine.spec.checkpoint
        return resume(ckpt.dir, ckpt.resume, self.load, self.engine.say)

    def close(self) -> None:
        self.saver.close()  # an async save in flight is published (or its error raised) first
