"""Issue #13's rule on real files (tests/fixtures/real_configs, SOURCES.md): an import keeps the meaning
of every field or refuses naming it, with each tool's own parser as the oracle.

- DeepSpeed JSON: DeepSpeed's DeepSpeedConfig built from the original file and from `explain` of the
  imported spec resolve to the same settings (stage, offload devices and pinning, precision and loss
  scaling, batch sizes, buckets, overlap / contiguous, stage-3 knobs, clipping, reduction dtype,
  everything else it parses). "auto" on the original side is resolved as its caller resolves it:
  polyshard's explain for what the spec decides, the model-sized values as Hugging Face fills them.
- accelerate YAML: accelerate's own launcher (`_validate_launch_command`, `prepare_*_env`) and plugin
  classes, run on the original and on `export --to accelerate` of its import, give the same
  FullyShardedDataParallelPlugin, the same resolved DeepSpeed config, the same mixed precision and
  process counts.
"""

import functools
import copy
import importlib.util
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

from accelerate_host import gpu_host
from parallel.interop.accelerate import from_accelerate
from parallel.interop.export import export
from parallel.registry import explain
from parallel.spec.io import SpecError, load_spec

pytest.importorskip("accelerate")
# DeepSpeed's own parser is the oracle for DeepSpeed files and accelerate's DeepSpeed sections only:
# the FSDP and multi-GPU accelerate files are checked without it
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
needs_deepspeed = pytest.mark.skipif(NO_DEEPSPEED, reason="needs deepspeed (pip install "
                                     "'polyshard[deepspeed]')")

from backends.deepspeed.config.translate import MODEL_AUTOS  # noqa: E402
from backends.deepspeed.files import interop as ds_interop  # noqa: E402
from backends.deepspeed.files.interop import read_config  # noqa: E402

from_deepspeed = functools.partial(ds_interop.from_deepspeed, validate=load_spec)  # the CLI's validation

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_configs"
DEEPSPEED_FILES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*")
                         if p.suffix in (".json", ".conf"))
ACCELERATE_FILES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.yaml"))
HIDDEN = 4096  # the hidden size "auto" bucket sizes are filled from, on both sides
# What cannot keep its meaning: the import fails naming exactly these source fields (--lossy then
# imports the rest; the oracle compares everything except `differs`).
REFUSED = {
    "axolotl__zero3_bf16_cpuoffload_params.json": ({"zero_optimization.offload_param"},
                                                   {"zero_config.offload_optimizer"}),
    "dsexamples__gptj_6b_zero2.json": ({"optimizer", "scheduler"}, set()),
    "dsexamples__llama_70b_multi_node.json": ({"optimizer", "scheduler"}, set()),
    "dsexamples__llama_7b_single_node.json": ({"optimizer", "scheduler"}, set()),
    "transformers__ds_config_zero3.json": ({"zero_optimization.reduce_bucket_size",
                                            "optimizer", "scheduler"}, None),  # DeepSpeed refuses it
    "accelerate__megatron.yaml": ({"distributed_type", "megatron_lm_config"}, None),
}
# What the command line gives (--set): the world size a file's explicit train_batch_size implies.
GIVEN = {"dsexamples__llama_70b_multi_node.json": {"topology": {"nodes": 4, "procs_per_node": 8}},
         "dsexamples__gptj_6b_zero2.json": {"topology": {"procs_per_node": 8}},
         "dsexamples__llama_7b_single_node.json": {"topology": {"procs_per_node": 8}}}
BATCH = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# Settings that are not training semantics: permission flags for the client optimizer polyshard always
# passes, and DeepSpeed's own logging (polyshard reports its numbers; a file's logging keys are kept).
NOT_COMPARED = ("zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print",
                "wall_clock_breakdown")


def _merge(spec: dict, given: dict) -> dict:
    out = dict(spec)
    for key, value in given.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _model_autos(config: dict) -> dict:
    zero = config.get("zero_optimization", {})
    for key, formula in MODEL_AUTOS.items():
        leaf = key.split(".")[1]
        if zero.get(leaf) == "auto":
            zero[leaf] = formula(HIDDEN)
    return config


# Paths whose "auto" the caller fills (transformers' trainer_config_process / accelerate's
# _prepare_deepspeed): from its own settings, which here are the spec's. DeepSpeed drops any other
# "auto" inside its config blocks and uses its default (config_utils.DeepSpeedConfigModel).
CALLER_FILLS = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping", "fp16.enabled", "bf16.enabled"}


def _resolve_caller(original: dict, ours: dict) -> dict:
    """The original file as its caller hands it to DeepSpeed: "auto" filled at CALLER_FILLS with the
    spec's values (polyshard's explain), at MODEL_AUTOS from the model, dropped elsewhere (DeepSpeed's
    default); absent batch sizes filled by the caller; optimizer / scheduler blocks left to the client
    optimizer polyshard passes (DeepSpeed ignores them then)."""
    def walk(orig, mine, path):
        out = {}
        for key, value in orig.items():
            full = f"{path}{key}"
            if full in ("optimizer", "scheduler"):
                continue
            if value == "auto" and full in MODEL_AUTOS:
                out[key] = value
            elif value == "auto" and full in CALLER_FILLS and key in mine:
                out[key] = mine[key]
            elif value == "auto" and full == "zero_optimization.stage3_gather_16bit_weights_on_model_save":
                out[key] = False  # accelerate's fill (and DeepSpeed's default)
            elif value == "auto":
                continue
            elif isinstance(value, dict):
                out[key] = walk(value, mine.get(key, {}) if isinstance(mine.get(key), dict) else {},
                                f"{full}.")
            else:
                out[key] = value
        return out

    out = walk(copy.deepcopy(original), ours, "")
    out.update({k: ours[k] for k in BATCH if k not in out and k in ours})
    return _model_autos(out)


def _plain(x):
    if hasattr(x, "model_dump"):
        return _plain(x.model_dump())
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x)
    if callable(x) and hasattr(x, "__name__"):
        return x.__name__
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return _plain(vars(x))
    return x


def _deepspeed_view(config: dict, world: int) -> dict:
    """Everything DeepSpeed's parser resolves from `config`, at `world` ranks."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    with mock.patch.object(deepspeed.comm, "get_world_size", lambda *a, **k: world), \
            mock.patch.object(deepspeed.comm, "get_rank", lambda *a, **k: 0):
        c = DeepSpeedConfig(copy.deepcopy(config))
    view = _plain({k: v for k, v in vars(c).items() if k not in ("_param_dict", "global_rank",
                                                               "world_size", *NOT_COMPARED)})
    if view["communication_data_type"] is None:  # engine.communication_data_type's rule
        view["communication_data_type"] = ("torch.float16" if c.float16_config.enabled else
                                           "torch.bfloat16" if c.bfloat16_config.enabled else
                                           "torch.float32")
    for block in ("float16_config", "bfloat16_config"):  # settings of a disabled mode are inert
        if not view[block]["enabled"]:
            view[block] = {"enabled": False}
    for block in ("offload_optimizer", "offload_param"):  # device none is DeepSpeed's "no offload"
        if (view["zero_config"].get(block) or {}).get("device") == "none":
            view["zero_config"][block] = None
    return view


def _diff(a, b, path="") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key, "<absent>"), b.get(key, "<absent>")
        if isinstance(x, dict) and isinstance(y, dict):
            out += _diff(x, y, f"{path}{key}.")
        elif x != y:
            out.append(f"{path}{key}: file {x!r} != polyshard {y!r}")
    return out


def test_the_corpus_is_real_and_large_enough():
    sources = (CORPUS / "SOURCES.md").read_text()
    files = [p for p in CORPUS.rglob("*") if p.is_file() and p.name != "SOURCES.md"]
    assert len(files) >= 30
    for p in files:
        assert f"| {p.relative_to(CORPUS)} |" in sources, p


@needs_deepspeed
@pytest.mark.parametrize("name", DEEPSPEED_FILES)
def test_deepspeed_file_means_the_same_to_deepspeed(name):
    cfg = read_config(CORPUS / name)
    refused, differs = REFUSED.get(Path(name).name, (None, set()))
    if refused:
        with pytest.raises(SpecError) as err:
            from_deepspeed(cfg, given=GIVEN.get(name, {}))
        assert {p for p, _ in err.value.problems} == refused, err.value.problems
        if differs is None:  # refused even with --lossy: DeepSpeed itself refuses the file
            with pytest.raises(SpecError):
                from_deepspeed(cfg, lossy=True, given=GIVEN.get(name, {}))
            return
    data, report = from_deepspeed(cfg, lossy=bool(refused), given=GIVEN.get(name, {}))
    assert {f for f, outcome, _ in report if outcome == "lost"} == (refused or set())
    spec = load_spec(_merge(data, GIVEN.get(name, {})))
    ours = _model_autos(explain(spec)["config"])
    diff = [d for d in _diff(_deepspeed_view(_resolve_caller(cfg, ours), spec.world_size),
                             _deepspeed_view(ours, spec.world_size))
            if not any(d.startswith(f"{p}") for p in differs)]
    assert not diff, "\n".join(diff)


def _accelerate_view(path: Path, flags: list[str], micro: int) -> dict:
    """What `accelerate launch --config_file path` sets up on a GPU host (commands/launch.py
    launch_command's path, GPU branch): plugins built by accelerate's own code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), *flags, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    kind = ("deepspeed" if args.use_deepspeed else "fsdp" if args.use_fsdp else
            "ddp" if args.multi_gpu else "one process")
    if args.use_deepspeed:  # what launch_command does before deepspeed_launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    with mock.patch("accelerate.utils.launch.is_port_in_use", lambda port: False):
        env = prepare_deepspeed_cmd_env(args)[1] if args.use_deepspeed else prepare_multi_gpu_env(args)
    view = {"processes": args.num_processes if kind != "one process" else 1,
            "machines": args.num_machines, "kind": kind,
            "mixed_precision": env.get("ACCELERATE_MIXED_PRECISION")}
    with mock.patch.dict(os.environ, env), gpu_host():
        if args.use_fsdp:
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
            view["fsdp"] = _plain({k: v for k, v in vars(plugin).items() if k != "param_init_fn"})
        if args.use_deepspeed:
            view["deepspeed"] = _accelerate_deepspeed(env, view, args, micro)
            # with DeepSpeed, accelerate trains in the precision the final config enables
            config = view["deepspeed"]["config"]
            view["mixed_precision"] = ("fp16" if config["float16_config"]["enabled"] else "bf16"
                                       if config["bfloat16_config"]["enabled"] else "no")
    return view


def _accelerate_deepspeed(env: dict, view: dict, args, micro: int) -> dict:
    """DeepSpeedPlugin's config as Accelerator._prepare_deepspeed finishes it (mixed precision, then
    the "auto" fills of accelerate 1.11: clipping 1.0, no 16-bit gather, the batch, h-sized buckets)."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()
    for block in ("optimizer", "scheduler"):  # the client optimizer's (the script passes one)
        plugin.deepspeed_config.pop(block, None)
    plugin.set_mixed_precision(view["mixed_precision"])
    ga = plugin.get_value("gradient_accumulation_steps")  # the script's batch: the spec's micro
    ga = 1 if ga in (None, "auto") else ga
    fills = {"gradient_clipping": 1.0,
             "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
             "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": ga,
             "train_batch_size": micro * ga * args.num_processes,
             **{k: f(HIDDEN) for k, f in MODEL_AUTOS.items()}}
    plugin.deepspeed_config_process(must_match=False, **fills)
    return {"config": _deepspeed_view(_model_autos(plugin.deepspeed_config), args.num_processes),
            "zero3_init_flag": plugin.zero3_init_flag}


@pytest.mark.parametrize("name", ACCELERATE_FILES)
def test_accelerate_file_means_the_same_to_accelerate(name, tmp_path, monkeypatch):
    path = CORPUS / name
    cfg = yaml.safe_load(path.read_text())
    if NO_DEEPSPEED and "deepspeed_config" in cfg:
        pytest.skip("an accelerate DeepSpeed file: its oracle needs deepspeed")

    refused, _ = REFUSED.get(Path(name).name, (None, set()))
    if refused:
        with pytest.raises(SpecError) as err:
            from_accelerate(cfg, path.parent)
        assert {p for p, _ in err.value.problems} == refused, err.value.problems
        return
    data, report = from_accelerate(cfg, path.parent)
    spec = load_spec(data)
    exported = export(spec, "accelerate")
    for file_name, content in exported.pop("__files__", {}).items():
        (tmp_path / file_name).write_text(content)
    (tmp_path / "exported.yaml").write_text(yaml.safe_dump(exported))
    flags = [] if "num_processes" in cfg else ["--num_processes", "2"]  # accelerate asks for it
    # accelerate opens deepspeed_config_file relative to the working directory; polyshard beside the
    # yaml: run accelerate from the yaml's directory, where both mean the same file
    monkeypatch.chdir(path.parent)
    original = _accelerate_view(path, flags, spec.micro_batch_size)
    monkeypatch.chdir(tmp_path)
    ours = _accelerate_view(tmp_path / "exported.yaml", flags, spec.micro_batch_size)
    diff = _diff(original, ours)
    assert not diff, "\n".join(diff)
    # importing the export again means the same: the backend gets the same settings (the spec may
    # now state what was a default, e.g. the global batch the DeepSpeed JSON writes)
    again = load_spec(from_accelerate(yaml.safe_load((tmp_path / "exported.yaml").read_text()),
                                      tmp_path)[0])
    assert _diff(explain(again), explain(spec)) == []
