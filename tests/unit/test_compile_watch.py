"""The compile section's meaning and the checks that torch.compile ran (parallel/engine/model/compile.py),
on one process with dynamo's `eager` backend (traces, generates no code: seconds)."""

import warnings

import pytest
import torch
from torch import nn

from parallel import load_spec
from parallel.engine.model.compile import CountingBackend
from parallel.engine.watch.compile import CompileWatch
from parallel.spec.compiling import Compile
from parallel.spec.errors import SpecError


class Block(nn.Module):
    """Like a Hugging Face decoder layer with its cache on: forward reads a per-instance int, so
    dynamo specialises each instance on it and compiles it again."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x)) + self.index


def run(blocks, steps, section, shape=(2, 8)):
    torch._dynamo.reset()
    backend = CountingBackend(section)
    units = [(f"blocks.{i}", b) for i, b in enumerate(blocks)]
    for _, b in units:
        b.compile(backend=backend, **section.torch_kwargs())
    watch = CompileWatch(units, backend, section, loud=True)
    for step in range(1, steps + 1):
        x = torch.randn(*(shape(step) if callable(shape) else shape), requires_grad=True)
        for b in blocks:
            x = b(x)
        x.sum().backward()
        watch.after_step(step)
    return watch


def test_every_unit_ran_compiled_when_nothing_specialises():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stats = run([Block(0) for _ in range(3)], 3, Compile(enabled=True, backend="eager")).stats()
    assert not [w for w in seen if "torch.compile" in str(w.message)], [str(w.message) for w in seen]
    assert (stats.units, stats.ran_compiled, stats.eager) == (3, 3, [])
    assert stats.graphs == 1 and stats.recompiles == 0 and stats.late_graphs == 0


def test_units_past_the_recompile_limit_are_named_as_eager():
    limit = torch._dynamo.config.recompile_limit  # 8 in torch 2.9
    blocks = [Block(i) for i in range(limit + 3)]
    with pytest.warns(RuntimeWarning, match=r"3 of 11 compiled module\(s\) ran eagerly.*blocks\.8"):
        stats = run(blocks, 2, Compile(enabled=True, backend="eager")).stats()
    assert stats.eager == ["blocks.8", "blocks.9", "blocks.10"]
    assert stats.ran_compiled == limit and stats.recompiles == limit - 1


def test_a_shape_that_changes_after_warm_up_warns_once_naming_the_code():
    section = Compile(enabled=True, backend="eager", dynamic=False)
    with pytest.warns(RuntimeWarning, match=r"compiled 1 graph\(s\) after step 2.*forward") as seen:
        watch = run([Block(0)], 5, section, shape=lambda step: (2 if step < 3 else step, 8))
    assert sum("after step 2" in str(w.message) for w in seen) == 1  # warned once, not per step
    assert watch.stats().late_graphs == 3 and watch.stats().recompiles == 3


def test_graph_breaks_are_counted_with_their_reason():
    class Breaking(Block):
        def forward(self, x):
            x = self.lin(x)
            torch._dynamo.graph_break()
            return torch.relu(x)

    with pytest.warns(RuntimeWarning, match="graph break"):
        stats = run([Breaking(0)], 2, Compile(enabled=True, backend="eager")).stats()
    assert stats.graph_breaks >= 1 and stats.graphs == 2 and stats.ran_compiled == 1


def test_compile_true_is_shorthand_and_each_backend_says_what_it_does():
    assert load_spec({"compile": True}).compile == Compile(enabled=True)
    assert load_spec({"compile": False}).compile == Compile()
    cases = {
        "compile.enabled": {"backend": "xla_fsdp", "compile": True},
        "fsdp.use_orig_params": {"fsdp": {"version": 1, "use_orig_params": False},
                                 "compile": True},
        "deepspeed.deepcompile": {"backend": "deepspeed", "deepspeed": {"deepcompile": True},
                                  "compile": True},
        "compile.mode": {"compile": {"enabled": True, "backend": "eager",
                                     "mode": "max-autotune"}},
    }
    for path, data in cases.items():
        with pytest.raises(SpecError) as err:
            load_spec(data)
        assert path in str(err.value), (path, str(err.value))
    whole = {"backend": "deepspeed", "deepspeed": {"deepcompile": True},
             "compile": {"enabled": True, "scope": "model"}}
    # DeepCompile asserts on any backend name but these two, and has no ZeRO-0 pass
    for path, change in (("compile.backend", {"compile": {**whole["compile"], "backend": "aot_eager"}}),
                         ("deepspeed.deepcompile", {"shard": "none"})):
        with pytest.raises(SpecError) as err:
            load_spec({**whole, **change})
        assert path in str(err.value), (path, str(err.value))
    spec = load_spec(whole)
    from backends.deepspeed.config.translate import translate

    assert translate(spec)["config"]["compile"] == {"deepcompile": True}


def test_a_mode_reaches_inductor_inside_the_backend():
    """torch.compile hands `mode` to a callable backend as a keyword; it travels inside ours."""
    section = Compile(enabled=True, mode="reduce-overhead")  # no CUDA graphs on a CPU tensor
    assert "mode" not in section.torch_kwargs()
    stats = run([Block(0)], 2, section).stats()
    assert stats.ran_compiled == 1 and stats.graphs >= 1


def test_deepcompile_names_an_arch_list_deepspeeds_builder_cannot_read():
    from backends.deepspeed.runtime.parallelize import check_arch_list

    for fine in ("", "9.0", "8.0;9.0+PTX", "8.6 9.0"):
        check_arch_list(fine)
    with pytest.raises(RuntimeError, match=r"TORCH_CUDA_ARCH_LIST='9.0a'.*\['9.0a'\]"):
        check_arch_list("9.0a")

