"""Reading files from elsewhere (configs, specs, checkpoint tables) as bounded data: a regular file
(not a FIFO, not a device), up to a size cap, UTF-8, with JSON / YAML nesting bounded and YAML aliases
refused before they expand (docs/security.md). Checkpoint pickles: parallel/checkpoint/safe.py."""

from __future__ import annotations

import json
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
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise FileError(f"{path}: nested more than {limit} levels deep ({what})")
        children = node.values() if isinstance(node, dict) else node if isinstance(
            node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


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
    """YAML (a superset of JSON) with aliases refused: a 1 KB file of nested aliases expands to
    billions of nodes (measured: `validate` ran for a minute, then aborted)."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(f"an alias (*{self.peek_event().anchor}) at line "
                                     f"{mark.line + 1}: aliases are refused in {what} (they can "
                                     "expand exponentially); write the values out")
            return super().compose_node(parent, index)

    text = read_text(path, what, limit)
    try:
        data = yaml.load(text, Loader=NoAliases)  # noqa: S506 - a SafeLoader without aliases
    except RecursionError:
        raise FileError(f"{path}: nested too deeply to parse ({what})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise FileError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', None) or err}") \
            from None
    check_depth(data, path, what)
    return data
