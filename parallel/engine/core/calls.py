"""The engine's public calls that hand straight to a part it owns: data loaders (loaders.py, packing.py),
checkpoints (checkpointing.py), the user's registered state (user_state.py), evaluation
(evaluate.py), the tracker and progress bar (tracking.py, progress_bar.py), and generation (a
backend hook). Each is a line or two, kept here so
that setup.py reads as the set-up and engine.py as the step; the parts are the engine's objects,
made in its __init__ (`loaders`, `checkpoints`, `preemption`, `user_state`, `tracker`)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from parallel.engine.core.hooks import BackendHooks
from parallel.engine.data import packing
from parallel.engine.data.guard import check_pack_args
from parallel.engine.data.loaders import build_loader


class EngineCalls(BackendHooks):
    # ---- data ----
    def dataloader(self, dataset, batch_size: int | None = None, shuffle: bool = True,
                   collate_fn=None, *, name: str | None = None, eval: bool = False,
                   drop_last: bool | None = None, accept_changed_data: bool = False,
                   pack_to: int | None = None, pad_token_id: int = 0, **torch_kwargs):
        """This rank's loader of step batches (micro_batch_size * grad_accum_steps samples each) of
        a map-style or iterable dataset (Hugging Face `datasets`, streaming too), sharded by
        data-parallel rank. A training loader's position is saved with the checkpoint under `name`;
        `eval=True` loaders never are (data/loaders.py). `torch_kwargs`: num_workers, pin_memory,
        prefetch_factor, persistent_workers, as torch's DataLoader takes them. `pack_to=N`: the
        dataset's items are tokenized documents, packed whole into rows of N tokens, attention and
        targets confined to each (data/packing.py); `pad_token_id` fills a row's end."""
        if drop_last is False and not eval:
            raise ValueError("engine.dataloader: drop_last=False on a training loader: its last "
                             "batch would be short and the step takes a fixed number of samples "
                             "per rank (micro_batch_size x grad_accum_steps); keep drop_last, or "
                             "pass eval=True for an evaluation loader")
        pack = None
        if pack_to is not None:
            pack, collate_fn = self._packer(pack_to, pad_token_id, collate_fn)
        loader = build_loader(dataset, size=batch_size or self.samples_per_step,
                              dp_size=self.dp_size, dp_rank=self.dp_rank, seed=self.spec.seed,
                              shuffle=shuffle, collate_fn=collate_fn,
                              drop_last=not eval if drop_last is None else drop_last,
                              device_loader=self._device_loader, eval_=eval, pack=pack,
                              **torch_kwargs)
        return self.loaders.add(loader, name, eval, accept_changed_data)

    def _packer(self, pack_to: int, pad_token_id: int, collate_fn):
        check_pack_args(pack_to, collate_fn)
        if self.model is None:
            raise ValueError("engine.dataloader(pack_to=...): call it after engine.prepare(): how "
                             "attention is confined to each document depends on the model's "
                             "attention implementation")
        mode = packing.mask_mode(self.attention, self.spec.compute, self.samples_per_step,
                                 pack_to, self.device)
        vocab = packing.vocab_of(self.model)  # every document's ids checked against it
        return packing.Packer(pack_to, pad_token_id, self.say, vocab), packing.collate(mode)

    # ---- evaluation, tracking, generation ----
    def evaluate(self, loader, metrics: list | tuple = (), max_batches: int | None = None) -> dict:
        """No-grad forward over `loader` (an eval loader: engine.dataloader(..., eval=True)): the
        token-weighted loss over every rank's samples, its perplexity, and each metric's
        (numerator, denominator) sums reduced over ranks in one collective (evaluate.py)."""
        from parallel.engine.infer import evaluate

        results = evaluate.run(self, loader, list(metrics), max_batches)
        self.tracker.log({f"eval/{k}": v for k, v in results.items()}, self.step)
        return results

    def log(self, metrics: dict, step: int | None = None) -> None:
        """Log the user's own {name: number} to every tracker of `tracking.to` (main rank; other
        ranks ignore it, so call it on every rank). `step`: default the current step."""
        self.tracker.log(metrics, self.step if step is None else step)

    def progress_bar(self, total: int | None = None, description: str = "training"):
        """`with engine.progress_bar(total) as bar: ... bar.update(result)`: a live bar in a
        terminal or notebook, a line every tracking.every steps in a log file (progress_bar.py)."""
        from parallel.engine.observe.progress_bar import ProgressBar

        return ProgressBar(self, total, description)

    def generate(self, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """Token ids (prompt + new, on the host) from the Hugging Face model being trained, on
        this rank's prompts, every rank in step where forwards gather; on XLA with static shapes
        (generate.py). Each rank passes its own prompts."""
        self._not_pipelined("engine.generate")
        self.model.eval()
        if self.router is not None or getattr(getattr(self.model, "config", None),
                                              "output_router_logits", False):
            # transformers 4.57.1's MoE models fail in generate with it on (the balancing loss
            # reads the whole sequence's mask against one new token's router logits: measured on
            # Mixtral, "size of tensor a (2) must match ... b (0)"); decoding needs no loss
            generate_kwargs.setdefault("output_router_logits", False)
        with self._whole_rows():
            return self._generate(input_ids, generate_kwargs)

    def _not_pipelined(self, what: str) -> None:
        if self.pipeline is not None:  # each rank holds some layers: no rank can run the model
            raise ValueError(f"{what} with topology.pp {self.dims.pp}: each rank holds only its "
                             "stages' layers; engine.save_pretrained(directory), then generate "
                             "from it at topology.pp: 1 (or with transformers directly)")

    def unwrap(self):
        """`with engine.unwrap() as model:` the Hugging Face model, to call directly (forward,
        generate with your own arguments); ranks must call it alike where forwards gather."""
        self._not_pipelined("engine.unwrap")
        self.model.eval()
        return self._unwrapped_whole()

    @contextmanager
    def _unwrapped_whole(self):
        with self._whole_rows(), self._unwrapped() as model, self._no_own_save(model):
            yield model

    @contextmanager
    def _no_own_save(self, model):
        """The library's `model.save_pretrained` refused inside unwrap on several ranks, naming
        engine.save_pretrained (#65): each rank holds its shards (every rank would write its own
        partial files into the same directory) or, replicated, every rank would write the same
        files at once. The model's own method is back after the block."""
        if self.world_size == 1 or not hasattr(model, "save_pretrained"):
            yield
            return

        def refused(*args, **kwargs):
            raise RuntimeError(f"model.save_pretrained inside engine.unwrap() on {self.world_size} "
                               "ranks: each rank holds its own shards of the model; call "
                               "engine.save_pretrained(directory) on every rank, which writes the "
                               "whole model in Hugging Face format from all of them")

        model.save_pretrained = refused  # an instance attribute over the class's method
        try:
            yield
        finally:
            del model.save_pretrained

    def _whole_rows(self):
        """With topology.cp, the model's own attention over whole rows (every rank of a cp group
        runs the same rows whole): what generation and a direct call see."""
        return self.context.plain() if self.context is not None else nullcontext()


    # ---- checkpoints (checkpointing.py) ----
    def save(self, path, async_save: bool | None = None) -> Path:
        """Write model, optimizer, scheduler, step, RNG and data position under `path`, atomically;
        `latest` beside it moves to it and `checkpoint.keep_last` applies. With
        `checkpoint.async_save` (or `async_save=True`) it returns once this rank's state is in host
        memory; the files are written and published in the background."""
        return self.checkpoints.save(path, async_save)

    def save_pretrained(self, directory, tokenizer=None, max_shard_bytes: int | None = None
                        ) -> Path:
        """The model in Hugging Face format, as `save_pretrained` writes it (sharded safetensors,
        config, generation config; a PEFT model: its adapter), written by every rank from its own
        shards, never gathered on one; `tokenizer`: a tokenizer object, saved beside it.
        `from_pretrained(directory)` loads the trained weights. `max_shard_bytes`: the largest
        weight file; by default the weights are split into about one file per rank, each at most
        save_pretrained's max_shard_size (5 GB), so every rank writes a share."""
        return self.checkpoints.save_pretrained(directory, tokenizer, max_shard_bytes)

    def load(self, path, trust: bool = False, weights_only: bool = False) -> dict:
        """Verify and restore what `save` wrote, whichever backend and world size wrote it; `path`
        may be a directory of checkpoints (its `latest`). Returns the manifest. `weights_only`:
        the model's weights alone, the optimizer and step left as they are (a checkpoint imported
        without optimizer state, or a fine-tune starting from a trained model)."""
        return self.checkpoints.load(path, trust, weights_only)

    def maybe_save(self) -> Path | None:
        """Save into checkpoint.dir/step-NNNNNNNN when checkpoint.every divides the step (not after
        a preemption save: that one is the step's)."""
        return None if self.preemption.pending is not None else self.checkpoints.maybe_save()

    def resume(self) -> dict | None:
        """With `checkpoint.resume: auto`, load checkpoint.dir's latest complete checkpoint if there
        is one; call it after prepare() and after creating the data loaders."""
        return self.checkpoints.resume()

    def wait_for_save(self) -> None:
        """Block until an async save in flight is published (its error, if any, is raised here)."""
        self.checkpoints.wait()

    def register_for_checkpointing(self, obj, name: str | None = None,
                                   per_rank: bool = False) -> str:
        """Save `obj.state_dict()` with every checkpoint and restore it with `obj.load_state_dict`
        on load/resume: one shared copy (the main rank's), or each rank's own (`per_rank`).
        Returns its name in the checkpoint (user_state.py)."""
        return self.user_state.register(obj, name, per_rank)
