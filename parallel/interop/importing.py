"""Reading other tools' config files into a spec (a kit: backends import it, it imports no backend).

`Import` is the spec being built from a file, the report of what each source field became, and what
cannot be kept; the accelerate file reader (parallel/interop/accelerate.py) and each backend's own
readers (its descriptor's accelerate section and config importers) fill one. The vocabulary below is
accelerate's, shared by every backend that reads an accelerate file.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable

from parallel.spec.errors import SpecError

STRATEGIES = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad_op", "NO_SHARD": "none",
              "HYBRID_SHARD": "hybrid", "HYBRID_SHARD_ZERO2": "hybrid_grad_op"}
BY_NUMBER = dict(zip("12345", STRATEGIES))  # accelerate's menu numbers 1-5
PREFETCH = {"BACKWARD_PRE": "backward_pre", "BACKWARD_POST": "backward_post", "NO_PREFETCH": "none"}
Report = list[tuple[str, str, str]]  # (source field, outcome, detail)


class Import:
    """The spec being built, the report, and what cannot be kept (shared shape with the DeepSpeed
    import)."""

    def __init__(self, lossy: bool, given: dict, validate: Callable[[dict], object]):
        self.spec: dict = {}
        # the spec validation the result must pass (the dispatcher's load_spec: a backend's reader
        # cannot name the spec class, which the registry assembles)
        self.validate = validate
        self.report: Report = []
        self.problems: list[tuple[str, str]] = []
        self.lossy, self.given = lossy, given  # given: --set values (they win, and decide "auto")
        self.caller = "polyshard"  # who fills "auto": polyshard (the spec) or accelerate
        self.sources: dict[str, str] = {}  # spec path -> the source field that set it

    def given_value(self, path: str):
        node = self.given
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def whole(self, source: str, value) -> int | None:
        """`value` as a whole number, or None with a problem naming `source`: a bool, string, list,
        fraction or non-finite number is not a count (what the tool would have crashed on, or
        read as something else)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and not (math.isfinite(value) and value.is_integer())):
            self.problems.append((source, f"{str(value)[:80]!r} is not a whole number"))
            return None
        return int(value)

    def set(self, path: str, value, source: str, outcome: str = "mapped", detail: str = "") -> None:
        node = self.spec
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        self.sources[path] = source
        self.report.append((source, outcome, detail or f"{path}: {value!r}"))

    def finish(self) -> tuple[dict, Report]:
        """The spec and report, or SpecError naming the source fields: what cannot be kept, and
        values the spec refuses (its rules are the target tool's, e.g. DeepSpeed's bucket bounds)."""
        try:  # also with problems already found: every problem is reported at once
            self.validate(merged(self.spec, self.given))
        except SpecError as err:
            self.problems += [(self._source_of(path), f"{message} (as spec field {path})")
                              for path, message in err.problems]
        if self.problems:
            raise SpecError(self.problems)
        return self.spec, self.report

    def _source_of(self, path: str) -> str:
        while path and path not in self.sources:
            path = path.rpartition(".")[0]
        return self.sources.get(path, path or "<file>")


    def note(self, source: str, outcome: str, detail: str) -> None:
        self.report.append((source, outcome, detail))

    def refuse(self, source: str, why: str, lossy_ok: bool = True) -> None:
        if self.lossy and lossy_ok:
            self.note(source, "lost", why)
        else:
            self.problems.append((source, why + ("; or pass --lossy to import without it"
                                                 if lossy_ok else "")))


# accelerate 1.16's parallelism_config keys (`accelerate config` and launch's
# --parallelism_config_* flags), without their prefix
PARALLELISM = {"dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend",
               "cp_comm_strategy", "sp_size", "sp_backend", "sp_seq_length",
               "sp_seq_length_is_variable", "sp_attn_implementation"}


def parallelism_sizes(imp: Import, par) -> dict:
    """An accelerate file's parallelism_config as {key without prefix: value}; a key accelerate
    does not read is a problem naming it (never silently dropped), as is a section that is not a
    mapping. The readers decide what each size means on their backend."""
    if not isinstance(par, dict):
        imp.problems.append(("parallelism_config", f"{str(par)[:80]!r} is not a mapping"))
        return {}
    out = {}
    for key, value in par.items():
        name = str(key).removeprefix("parallelism_config_")
        if name not in PARALLELISM:
            hint = difflib.get_close_matches(name, sorted(PARALLELISM), n=1, cutoff=0.75)
            imp.problems.append((f"parallelism_config.{key}", "accelerate 1.16 does not read it"
                                 + (f"; did you mean 'parallelism_config_{hint[0]}'?" if hint else "")))
        else:
            out[name] = value
    return out


def merged(spec: dict, given: dict) -> dict:
    """`spec` with the --set values `given` laid over it."""
    out = dict(spec)
    for key, value in given.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def wrap_section(imp: Import, fsdp: dict) -> None:
    """TRANSFORMER_BASED_WRAP (+ classes, or none: the model's _no_split_modules), SIZE_BASED_WRAP
    (+ fsdp_min_num_params, 1e8 when absent), NO_WRAP or absent: only the root."""
    policy = fsdp.get("fsdp_auto_wrap_policy")
    classes = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [c.strip() for c in classes.split(",") if c.strip()]
    source = "fsdp_config.fsdp_auto_wrap_policy"
    if policy == "TRANSFORMER_BASED_WRAP":
        if classes:
            imp.set("wrap", {"policy": "layer_classes", "layer_classes": list(classes)}, source,
                    detail=f"wrap: layer_classes {list(classes)}")
        else:
            imp.set("wrap", {"policy": "auto"}, source, detail="wrap.policy: auto (no class list: "
                    "accelerate reads the model's _no_split_modules, as auto does)")
    elif policy == "SIZE_BASED_WRAP":
        threshold = int(float(fsdp.get("fsdp_min_num_params", 1e8)))
        imp.set("wrap", {"policy": "size", "min_num_params": threshold}, source,
                detail=f"wrap: size >= {threshold}")
    elif policy in (None, "NO_WRAP"):
        imp.set("wrap", {"policy": "none"}, source, "mapped" if policy else "default",
                "wrap.policy: none (only the root" + (", accelerate's default)" if policy is None
                                                       else ")"))
        if classes:
            imp.note("fsdp_config.fsdp_transformer_layer_cls_to_wrap", "ignored", "no "
                     "TRANSFORMER_BASED_WRAP policy reads it")
    else:
        imp.problems.append((source, f"{policy!r}: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or "
                             "NO_WRAP"))


def strategy(imp: Import, value, source: str) -> str | None:
    name = BY_NUMBER.get(str(value), str(value).upper())
    if name not in STRATEGIES:
        hint = difflib.get_close_matches(name, list(STRATEGIES), n=1, cutoff=0.6)
        imp.problems.append((source, f"{value!r} is no FSDP sharding strategy (1-5 or "
                             f"{', '.join(STRATEGIES)})" + (f"; did you mean {hint[0]!r}?"
                                                            if hint else "")))
        return None
    return STRATEGIES[name]
