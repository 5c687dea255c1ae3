"""What the small files of a checkpoint may hold, as schemas (contents.py parses them): the trainer
state and the data loaders' positions (trainer.pt), and a PEFT run's adapter configs
(peft_config.json), read as data: no module named by the file is imported, its regular expressions
are bounded and cannot backtrack without end, its sizes are bounded (docs/security.md)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints
from typing_extensions import TypedDict

COUNT = Annotated[int, Field(strict=True, ge=0, le=1 << 62)]  # steps, samples, epochs
POSITIVE = Annotated[int, Field(strict=True, ge=1, le=1 << 40)]  # batch sizes, world sizes
NAME = Annotated[str, StringConstraints(min_length=1, max_length=255)]


class LoaderState(TypedDict, total=False):
    """A data loader's position (parallel/engine/data: map-style loaders count samples, iterable
    ones batches)."""

    epoch: COUNT
    samples_done: COUNT
    batches_done: COUNT
    batch_size: POSITIVE
    world_size: POSITIVE
    fingerprint: dict[str, Any] | None
    dataset_state: Any


class TrainerState(TypedDict):
    """trainer.pt: the step, the scheduler's state_dict and every named loader's position (a list in
    checkpoints before loaders had names)."""

    step: COUNT
    scheduler: dict[str, Any] | None
    loaders: dict[NAME, LoaderState] | list[LoaderState]


REGEX_LIMIT = 1024  # characters of one pattern from a file (peft's target_modules and its kin)
PATTERNS_LIMIT = 4096  # names or patterns in one list


def bounded_regex(pattern: str) -> str:
    """A regular expression from a file, refused when it could backtrack without end: longer than
    REGEX_LIMIT, or an unbounded repetition of something that itself repeats or branches
    ('(a+)+', '(a|a)*': exponential on a near miss, measured minutes inside peft on a 30-character
    module name). Patterns such as '.*\\.(q_proj|v_proj)' pass."""
    if len(pattern) > REGEX_LIMIT:
        raise ValueError(f"a pattern of {len(pattern):,} characters (at most {REGEX_LIMIT:,})")
    try:
        parsed = _sre_parse(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise ValueError(f"not a regular expression ({err})") from None
    if _nested_repeat(parsed, inside=False):
        raise ValueError("an unbounded repetition of a repeating or alternating group, which can "
                         "backtrack without end; write the names out, or a simpler pattern")
    return pattern


def _sre_parse(pattern: str):
    try:
        from re import _parser as sre_parse  # Python 3.11+
    except ImportError:  # pragma: no cover
        import sre_parse
    return sre_parse.parse(pattern)


def _nested_repeat(items, inside: bool) -> bool:
    from re import _constants as c

    for op, av in items:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            low, high, body = av
            unbounded = high == c.MAXREPEAT
            if inside and (unbounded or high > 1):
                return True
            if _nested_repeat(body, inside or high > 1):
                return True
        elif op == c.BRANCH:
            if inside:
                return True
            if any(_nested_repeat(b, inside) for b in av[1]):
                return True
        elif op == c.SUBPATTERN:
            if _nested_repeat(av[-1], inside):
                return True
        elif op in (c.ASSERT, c.ASSERT_NOT):
            if _nested_repeat(av[1], inside):
                return True
    return False


REGEX = Annotated[str, AfterValidator(bounded_regex)]
PATTERNS = REGEX | Annotated[list[NAME], Field(max_length=PATTERNS_LIMIT)] | None


class AdapterConfig(TypedDict, total=False):
    """One adapter's config (peft's own to_dict()): the fields that name code, patterns or sizes are
    checked here; the rest go to peft's config class, which checks its own."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]

    peft_type: Annotated[str, StringConstraints(pattern=r"^[A-Z_]{1,32}$")]
    target_modules: PATTERNS
    exclude_modules: PATTERNS
    layers_pattern: PATTERNS
    rank_pattern: Annotated[dict[REGEX, Any], Field(max_length=PATTERNS_LIMIT)] | None
    alpha_pattern: Annotated[dict[REGEX, Any], Field(max_length=PATTERNS_LIMIT)] | None
    r: Annotated[int, Field(strict=True, ge=1, le=1 << 16)]
    megatron_config: None  # a Megatron layer set-up imports `megatron_core` by name: refused
    megatron_core: Annotated[str, StringConstraints(pattern=r"^megatron\.core$")] | None
    auto_mapping: None  # a custom model class: the repository's code, refused


class PeftFile(TypedDict):
    """peft_config.json: the run's adapters and the active one."""

    active: NAME
    adapters: Annotated[dict[NAME, AdapterConfig], Field(min_length=1, max_length=256)]


class ManifestSpec(TypedDict, total=False):
    """The spec a manifest records: what readers of the manifest use of it (the rest is kept)."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    precision: Literal["fp32", "bf16", "fp16", "fp8"]
    grad_clip: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None


class Manifest(TypedDict, total=False):
    """manifest.json (directory.py writes it); checked beyond read_manifest's format rules."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    spec: ManifestSpec | None
    user_state: dict[NAME, Literal["per_rank", "shared"]]
    state_dict: Literal["sharded", "full"]
    versions: dict[NAME, Annotated[str, StringConstraints(max_length=255)]]
    world_size: POSITIVE
    step: COUNT


def parse(schema, data, file: Path, what: str):
    """`data` validated by `schema` (a pydantic model or TypeAdapter-able type); a violation is an
    UnsafeFileError naming the file, the field and the rule."""
    from pydantic import TypeAdapter, ValidationError

    from parallel.checkpoint.format.safe import UnsafeFileError

    try:
        return TypeAdapter(schema).validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or not any(
            c in p for c in "[(")) or "(the whole file)"  # the keys, not pydantic's union labels
        raise UnsafeFileError(f"{file}: {what}: field {field}: {first['msg']} (got "
                              f"{str(first.get('input'))[:80]!r}); not a file polyshard "
                              "wrote") from None
