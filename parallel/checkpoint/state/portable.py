"""The portable state every backend writes and reads (docs/checkpoint-format.md).

In memory it is one nested dict, the shape torch's `get_state_dict` already uses:

    {"model": {name: tensor},
     "optim": {"state": {name: {"step": t, "exp_avg": t, ...}},
               "param_groups": [{"lr": ..., ..., "params": [name, ...]}]}}

where every `name` is the parameter's name in the original, unwrapped model. "model" holds every key
of that model's `state_dict()`, tied weights under each of their names (torch's layout); the optimizer
keys a tied parameter by its first name in `named_parameters()`. Frozen parameters are in "model"
and nowhere in "optim". On disk it is a
torch.distributed.checkpoint (DCP) directory, `state/`: DCP records each tensor's global shape and the
chunks each rank wrote, so any world size, and any backend, reads it back into its own layout.
Tensors may be DTensors or sharded tensors (each rank writes its shards) or whole tensors (written once).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parallel.checkpoint.state.chunks import RangeLoadPlanner, RangeSavePlanner
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.format.safe import safe_reader_class
from parallel.checkpoint.state.state_files import RecordingWriter, no_zip_crc
from parallel.files import FileError
from parallel.kits.names import clean_name  # noqa: F401 - state code names things by it

STATE_DIR = "state"


class SafeReader(safe_reader_class(dcp.FileSystemReader)):
    """DCP's reader with its index and byte entries read as data (parallel/checkpoint/format/safe.py): DCP
    itself unpickles both with full pickle. The index (O(keys x writers)) is parsed once per reader:
    a converter that reads a few keys per call would otherwise parse all of it on every call."""

    _index = None

    def read_metadata(self, *args, **kwargs):
        if self._index is None:
            self._index = super().read_metadata(*args, **kwargs)
        return self._index


def dcp_load(template: dict, reader: SafeReader, planner=None, no_dist: bool = True) -> None:
    """dcp.load, with the index checked before DCP sees it (DCP swallows a failing index read and
    then asserts) and a refused entry raised as itself, not inside DCP's CheckpointException."""
    reader.read_metadata()
    try:
        with _quiet_dcp():
            dcp.load(template, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as err:
        raise_refusal(err)
        raise


def raise_refusal(err: CheckpointException) -> None:
    """The first file refusal (FileError) inside a DCP failure, raised as itself."""
    for failure in err.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, FileError):
            raise inner from None


@contextlib.contextmanager
def _quiet_dcp():
    """DCP's writer calls the deprecated tensor.storage(), and single-writer saves and reads
    (no_dist) are deliberate here: both warnings are torch's, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


class PortableStateError(RuntimeError):
    """The checkpoint's state does not fit this run (another model or another optimizer)."""


def buffers(module) -> dict[str, torch.Tensor]:
    """Persistent buffers of a (maybe wrapped) module by portable name, on CPU: its state_dict
    entries that are no parameter under any of their names (a tied weight's other names included)."""
    params = {clean_name(n) for n, _ in module.named_parameters(remove_duplicate=False)}
    return {clean_name(k): v.detach().cpu() for k, v in module.state_dict().items()
            if clean_name(k) not in params}


def save_state(state: dict, into: Sink | Path, planner=None, collective: bool = True) -> None:
    """Write `state` under the save's directory/state (`into`: the save's Sink, or a directory for a
    one-off write). Collective: every rank calls it with its part (a rank may hold a subset of the
    keys; whole tensors held by several ranks are written once). A StagedSink
    (checkpoint.async_save) copies the state to host memory and queues the write."""
    sink = into if isinstance(into, Sink) else Sink(into)
    state = sink.kept(state)
    if not state:  # a part this save does not keep (the optimizer, for save_pretrained)
        return
    if sink.defer(state, planner, collective):  # a StagedSink: copied now, written by the writer
        return
    state = as_written(state)
    alone = not (collective and dist.is_initialized())
    # plans cached per kind of save, number of writers and storage writer (chunks.RangeSavePlanner;
    # a cached final plan carries its storage writer's own data: file names, or none for a capture)
    writers = 1 if alone else dist.get_world_size(sink.group)
    key = f"{','.join(sink.sections or ['all'])}:{writers}:{sink.kind}"
    with _quiet_dcp(), no_zip_crc():
        dcp.save(state, storage_writer=sink.storage_writer() or RecordingWriter(sink, sink.tmp / STATE_DIR),
                 planner=planner or RangeSavePlanner(key),
                 process_group=sink.group, no_dist=alone)


def as_written(state: dict) -> dict:
    """The state as DCP is given it: param_groups one object (a tuple), since DCP's and XLA's SPMD
    planners would flatten a list apart."""
    optim = state.get("optim")
    if optim is None or "param_groups" not in optim:
        return state
    return {**state, "optim": {**optim, "param_groups": tuple(optim["param_groups"])}}


def entry_of(key: str) -> str:
    """The model entry a stored key belongs to: model.<name>, optim.state.<name>.<field>."""
    if key.startswith("optim.state."):
        return key[len("optim.state."):].rpartition(".")[0]
    return key.partition(".")[2]


def write_queued(sink: Sink) -> None:
    """Write a staged save's queued host copies (after `save` returned; none when not staged)."""
    for state, planner, collective in sink.take_queued():
        save_state(state, sink, planner, collective)


def open_state(path: Path) -> SafeReader:
    """One reader of path/state for a whole load: DCP's index (O(keys x writers): hundreds of MB
    for a 70B model written by a thousand ranks) is parsed once, however many reads use it."""
    return SafeReader(str(path / STATE_DIR))


def load_state(template: dict, path: Path, planner=None, collective: bool = True,
               reader: SafeReader | None = None, elsewhere: frozenset[str] = frozenset()) -> dict:
    """Fill `template` (this run's layout: DTensors, shards or whole tensors) from path/state.
    Strict both ways within the sections asked for ("model", "optim"): DCP itself refuses a template
    key the checkpoint lacks; a stored entry the template does not ask for would be silently
    dropped, so it is refused here, unless it belongs to `elsewhere` (the model's entries other
    ranks hold: topology.pp's other stages)."""
    reader = reader or open_state(path)
    sections = tuple(f"{name}." if name == "model" else "optim.state." for name in template)
    unread = {k for k in stored_keys(path, reader) if k.startswith(sections)}
    unread -= set(flatten_state_dict(template)[0])
    unread = {k for k in unread if entry_of(k) not in elsewhere}
    if unread:
        raise PortableStateError(
            f"{path / STATE_DIR}: holds {len(unread)} entries this run has no place for (e.g. "
            f"{sorted(unread)[:3]}); it was written for another model or optimizer")
    try:
        dcp_load(template, reader, planner or RangeLoadPlanner(),
                  no_dist=not (collective and dist.is_initialized()))
    except FileError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException; name the cause
        raise PortableStateError(_explain_load_failure(path, template, err)) from err
    if isinstance(template.get("optim"), dict):
        template["optim"]["param_groups"] = list(template["optim"]["param_groups"])
    return template


def _explain_load_failure(path: Path, template: dict, err: Exception) -> str:
    try:
        saved = stored_keys(path)
    except Exception:  # noqa: BLE001 - unreadable metadata: report the original error
        return f"{path / STATE_DIR}: could not be read ({err})"
    wanted = set(flatten_state_dict(template)[0])
    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    if missing or extra:
        return (f"{path / STATE_DIR}: this run needs {len(missing)} entries the checkpoint lacks "
                f"(e.g. {missing[:3]}) and the checkpoint has {len(extra)} this run does not use "
                f"(e.g. {extra[:3]}); it was written for another model or optimizer (an SGD "
                "checkpoint has momentum_buffer, an Adam one exp_avg/exp_avg_sq)")
    return f"{path / STATE_DIR}: {type(err).__name__}: {err}"


def metadata(path: Path, reader: SafeReader | None = None):
    return (reader or open_state(path)).read_metadata()


def stored_keys(path: Path, reader: SafeReader | None = None) -> set[str]:
    return set(metadata(path, reader).state_dict_metadata)


def tensor_shapes(path: Path, prefix: str = "", reader: SafeReader | None = None
                  ) -> dict[str, tuple[list[int], torch.dtype]]:
    """Global shape and dtype of every stored tensor whose key starts with `prefix`."""
    md = metadata(path, reader).state_dict_metadata
    return {k[len(prefix):]: (list(v.size), v.properties.dtype) for k, v in md.items()
            if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)}


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """The whole model state as plain CPU tensors, in this process only (no collectives): for
    export, inspection and tests."""
    reader = open_state(path)
    template = {"model": {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype)
                          in tensor_shapes(path, "model.", reader).items()}}
    return load_state(template, path, collective=False, reader=reader)["model"]


def read_tensors(path: Path, wanted: dict[str, tuple], reader=None) -> dict[str, torch.Tensor]:
    """Stored tensors by flat key ("model.lm_head.weight", "optim.state.<name>.exp_avg") ->
    (shape, dtype), read alone in this process: DCP reads only the chunks a partial template asks
    for, so a converter holds what it asked for, never the model. Pass one SafeReader for a
    sequence of calls."""
    template: dict[str, dict] = {}
    for key, (shape, dtype) in wanted.items():
        head, _, rest = key.partition(".")
        template.setdefault(head, {})[rest] = torch.empty(shape, dtype=dtype)
    dcp_load(template, reader or open_state(path))
    return {key: template[key.partition(".")[0]][key.partition(".")[2]] for key in wanted}


