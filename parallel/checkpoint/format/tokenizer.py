"""A tokenizer from a directory, copied into an export as data (`ckpt export --to hf --tokenizer DIR`):
the directory's files are regular files within a cap (no link, FIFO or device: a FIFO would hang the
read), no config asks for a repository's code (`auto_map`), transformers loads it local-only with
`trust_remote_code=False` (never the "run custom code? [y/N]" prompt), and the names it will write
under (its named chat templates) are plain names, so everything lands inside the output directory
(docs/security.md)."""

from __future__ import annotations

import re
from pathlib import Path

from parallel.files import FileError, load_json, regular_file

FILE_LIMIT = 1 << 30  # one tokenizer file (a 256k-vocabulary tokenizer.json is ~35 MB)
ENTRIES_LIMIT = 256  # files in a tokenizer directory
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
CONFIGS = ("tokenizer_config.json", "config.json", "special_tokens_map.json")


class TokenizerError(FileError):
    """A tokenizer directory that asks for code, reaches outside itself, or is not plain data."""


def check_tokenizer_dir(source: Path) -> None:
    """The directory's files, before transformers opens any of them."""
    if source.is_symlink() or not source.is_dir():
        raise TokenizerError(f"--tokenizer {source}: a directory of tokenizer files (not a link)")
    entries = sorted(source.rglob("*"))
    if len(entries) > ENTRIES_LIMIT:
        raise TokenizerError(f"--tokenizer {source}: {len(entries)} entries, more than the "
                             f"{ENTRIES_LIMIT} a tokenizer has")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            continue
        regular_file(entry, "a tokenizer file", FILE_LIMIT, follow=False)
    for name in CONFIGS:
        file = source / name
        data = load_json(file, "a tokenizer config", follow=False) if file.exists() else {}
        if isinstance(data, dict) and "auto_map" in data:
            raise TokenizerError(f"{file}: auto_map {sorted(data['auto_map'])[:4]} asks for its "
                                 "repository's own code, which polyshard never runs; export "
                                 "without --tokenizer and add a tokenizer transformers ships")


def check_template_names(tokenizer, source: Path) -> None:
    """Named chat templates become files chat_templates/NAME.jinja when saved: plain names only."""
    templates = getattr(tokenizer, "chat_template", None)
    for name in templates if isinstance(templates, dict) else ():
        if not (isinstance(name, str) and TEMPLATE_NAME.fullmatch(name)):
            raise TokenizerError(f"{source}: chat template name {str(name)[:80]!r} is not a plain "
                                 "name (letters, digits, '_', '.', '-'); saving it would write "
                                 "outside the export")


def save_tokenizer(source: str | Path, out: Path) -> None:
    from transformers import AutoTokenizer

    source = Path(source)
    check_tokenizer_dir(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True,
                                                  trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TokenizerError(f"--tokenizer {source}: transformers cannot load it ({err})") \
            from None
    check_template_names(tokenizer, source)
    tokenizer.save_pretrained(str(out))
