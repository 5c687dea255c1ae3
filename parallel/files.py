"""Reading files from elsewhere (configs, specs, checkpoint tables) as bounded data: a regular file
(not a FIFO, not a device), up to a size cap, UTF-8, with JSON / YAML nesting bounded and YAML aliases
refused before they expand (docs/security.md). Checkpoint pickles: parallel/checkpoint/format/safe.py."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

CONFIG_LIMIT = 16 << 20  # a spec, accelerate YAML, DeepSpeed JSON or HF config.json
MAX_DEPTH = 64  # nesting of JSON / YAML documents


class FileError(ValueError):
    """A file that is not the data it claims to be (its kind, size, encoding or nesting); the
    message names the file and the rule."""


def regular_file(path: Path, what: str, limit: int, follow: bool = True) -> int:
    """The file's size, once it is known to be a regular file within `limit` bytes. `follow`: a
    symbolic link to a regular file is accepted (configs), or refused (checkpoint internals)."""
    path = Path(path)
    try:
        info = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        raise FileError(f"{path}: no such file ({what})") from None
    if stat.S_ISLNK(info.st_mode):
        raise FileError(f"{path}: a symbolic link where {what} must be a file of its own")
    if not stat.S_ISREG(info.st_mode):
        raise FileError(f"{path}: not a regular file (a FIFO, device or directory) where "
                              f"{what} must be one; reading it could block or never end")
    if info.st_size > limit:
        raise FileError(f"{path}: {info.st_size:,} bytes, more than the {limit:,} {what} may "
                              "have")
    return info.st_size


def read_bytes(path: Path, what: str, limit: int, follow: bool = True) -> bytes:
    regular_file(path, what, limit, follow)
    with open(path, "rb") as f:  # the size was checked; a file growing meanwhile is cut at limit
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileError(f"{path}: grew past {limit:,} bytes while read ({what})")
    return data


def read_text(path: Path, what: str, limit: int = CONFIG_LIMIT, follow: bool = True) -> str:
    data = read_bytes(path, what, limit, follow)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); {what} "
                              "must be UTF-8") from None


def check_depth(data, path: Path, what: str, limit: int = MAX_DEPTH) -> None:
    """Nesting within `limit`, and every number finite: YAML's .inf / .nan and hjson's 1e999 parse
    as floats that no config means (a gradient_clipping of .nan read as 'no clipping', a batch of
    1e999 as a crash deep inside an import); refused naming the key."""
    stack = [(data, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if depth > limit:
            raise FileError(f"{path}: nested more than {limit} levels deep ({what})")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(
            node, list) else ()
        for key, child in items:
            at = f"{where}.{key}" if where else str(key)
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, at))
            elif isinstance(child, float) and not math.isfinite(child):
                raise FileError(f"{path}: {at[:200]}: {child} is not a finite number ({what}); "
                                "write a finite value, or leave the key out")


def load_json(path: Path, what: str, limit: int = CONFIG_LIMIT, follow: bool = True):
    text = read_text(path, what, limit, follow)
    try:
        data = json.loads(text)
    except RecursionError:
        raise FileError(f"{path}: nested too deeply to parse ({what})") from None
    except ValueError as err:
        raise FileError(f"{path}: not valid JSON ({err}); {what} must be JSON") from None
    check_depth(data, path, what)
    return data


def load_yaml(path: Path, what: str, limit: int = CONFIG_LIMIT):
    """YAML (a superset of JSON), parsed by libyaml where PyYAML has it (a 4.7 MB spec: 2.7 s, against
    13 s in PyYAML's Python parser). Its events are read first, and the file is refused at the
    first alias (a 1 KB file of nested aliases expands to billions of nodes: `validate` ran for a
    minute, then aborted) or the first node nested past MAX_DEPTH. Both are found before anything
    is built: libyaml's composer recurses in C (`[` * 100,000 crashed the process) and takes
    minutes on deep flow nesting; the scan stops at the 65th level in milliseconds."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    text = read_text(path, what, limit)
    try:
        _scan_events(yaml.parse(text, Loader=loader), path, what)
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader, aliases refused above
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise FileError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}") \
            from None
    check_depth(data, path, what)
    return data


def _scan_events(events, path: Path, what: str) -> None:
    import yaml

    depth = 0
    for event in events:
        if isinstance(event, yaml.AliasEvent):
            mark = event.start_mark
            raise FileError(f"{path}: an alias (*{event.anchor}) at line {mark.line + 1}: aliases "
                            f"are refused in {what} (they can expand exponentially); write the "
                            "values out")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise FileError(f"{path}: nested more than {MAX_DEPTH} levels deep at line "
                                f"{event.start_mark.line + 1} ({what})")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def write_atomic(path: Path, data: bytes) -> None:
    """Write a small run file (a tracker's kept run id) whole or not at all, never through a link:
    a temporary file created anew beside it (O_EXCL | O_NOFOLLOW), fsynced, then renamed over
    `path` (a rename replaces a planted link itself, never what it points at)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def open_plain(path: Path, what: str, flags: int, mode: str, **kwargs):
    """`path` opened as a regular file of its own: no link followed, no FIFO waited on (opened
    non-blocking, checked, then blocking again); refused naming `what` otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        raise FileError(f"{path}: cannot open it ({what}: {err.strerror}; a symbolic link "
                        "or a FIFO is refused)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FileError(f"{path}: not a regular file ({what})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, **kwargs)


def open_append(path: Path, what: str):
    """A run file opened to append (metrics.jsonl), refused when it is a link or not a regular
    file (a FIFO would block the job, a link would write elsewhere)."""
    return open_plain(path, what, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "a", encoding="utf-8")


def plain_folder(path: Path, what: str) -> Path:
    """A folder polyshard writes run files into: created if missing, refused when it, or anything
    directly in it, is a symbolic link (a tracker's library would write through it)."""
    path = Path(path)
    if path.is_symlink():
        raise FileError(f"{path}: a symbolic link where {what} must be a folder of its own")
    path.mkdir(parents=True, exist_ok=True)
    links = [e.name for e in os.scandir(path) if e.is_symlink()]
    if links:
        raise FileError(f"{path / links[0]}: a symbolic link inside {what} ({len(links)} such); "
                        "polyshard writes run files only into a folder of plain files: remove it")
    return path
