"""`engine.resume()`'s decisions, said out loud: what it resumed from, or why it starts fresh (a typo in
`checkpoint.dir` looked like a first run), and, when `latest` is damaged, the newest intact checkpoint
by name, which `checkpoint.resume: latest_valid` falls back to by itself (auto stops, naming it and
how to resume from it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from parallel.checkpoint.format.directory import LATEST, STEP_NAME, resolve, step_checkpoint
from parallel.checkpoint.format.manifest import Verification
from parallel.checkpoint.format.safe import CheckpointError


class ResumeError(CheckpointError):
    """`latest` is damaged and `checkpoint.resume: auto` does not fall back: names what would."""


def resume(root: str | None, mode: str, load: Callable[[Path], dict],
           say: Callable[[str], None]) -> dict | None:
    """Load `root`'s latest checkpoint per `mode` (never | auto | latest_valid) and return its
    manifest, or None (starting fresh, said)."""
    if mode == "never" or not root:
        return None
    root = Path(root)
    if not root.is_dir():
        say(f"resume ({mode}): checkpoint.dir {root} does not exist: starting fresh. If this job "
            "should continue an earlier one, checkpoint.dir is mistyped")
        return None
    if not (root / LATEST).is_file():
        kept = sorted(d.name for d in root.iterdir() if STEP_NAME.fullmatch(d.name))
        say(f"resume ({mode}): {root} has no `latest` checkpoint: starting fresh" + (
            f" (it holds {kept[-1]}, never published: a save that did not finish)" if kept else ""))
        return None
    try:
        manifest = load(root)
    except CheckpointError as err:
        return _after_damage(root, mode, load, say, err)
    say(f"resumed from {resolve(root)}: step {manifest['step']}, written by "
        f"{manifest.get('backend')} on {manifest.get('world_size')} rank(s)")
    return manifest


def _after_damage(root: Path, mode: str, load, say, err: CheckpointError) -> dict:
    broken = resolve(root)
    intact = newest_intact(root, exclude=broken)
    if intact is None:
        raise ResumeError(f"{err}\n`latest` ({broken.name}) is damaged and no other checkpoint in "
                          f"{root} is intact: nothing to resume from") from None
    if mode != "latest_valid":
        raise ResumeError(f"{err}\n`latest` ({broken.name}) is damaged; the newest intact "
                          f"checkpoint is {intact}: resume from it with engine.load('{intact}'), "
                          "or set checkpoint.resume: latest_valid to fall back by itself") from None
    say(f"WARNING resume (latest_valid): `latest` ({broken.name}) is damaged ({err}); falling back "
        f"to the newest intact checkpoint {intact.name}: the steps after it are run again")
    manifest = load(intact)
    say(f"resumed from {intact}: step {manifest['step']}")
    return manifest


def newest_intact(root: Path, exclude: Path) -> Path | None:
    """The newest step-N checkpoint under `root` (by the N of its name, which its manifest must
    say too: keep_last's rule, directory.step_checkpoint) that verifies: every rank checks its share
    of each candidate's digests, newest first (collective, like a load)."""
    steps = {d: step_checkpoint(d) for d in root.iterdir() if d.resolve() != exclude.resolve()}
    candidates = sorted((d for d, n in steps.items() if n is not None), key=steps.get,
                        reverse=True)
    for path in candidates:
        try:
            Verification(path).agree()
        except CheckpointError:
            continue
        return path
    return None
