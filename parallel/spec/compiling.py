"""The `compile` section: torch.compile with one meaning on every backend that runs it.

What is compiled is decided by `scope` (the shard units, or the whole model), never by the backend;
how each backend applies it (and why in that order) lives in parallel/engine/model/compile.py and the
backend's engine. `compile: true` is shorthand for `compile: {enabled: true}`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from parallel.spec.sections import Section, rule_error


class Compile(Section):
    enabled: Annotated[
        bool,
        Field(description="Run the model's forward (and, through AOTAutograd, its backward) as "
              "graphs compiled by torch.compile. The engine checks that every compiled module "
              "ran compiled code and warns, naming it, when one ran eagerly or keeps recompiling "
              "(docs/compile.md)."),
    ] = False
    scope: Annotated[
        Literal["blocks", "model"],
        Field(description="blocks: each shard unit the wrap policy selects (e.g. every decoder "
              "layer) is compiled on its own; units of one class share one compiled graph, so "
              "compile time does not grow with depth (torchtitan's and Accelerate's regional "
              "compilation). model: the whole model in one torch.compile call (DeepSpeed: "
              "DeepSpeedEngine.compile()); graphs still break where the backend's hooks run."),
    ] = "blocks"
    mode: Annotated[
        Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        Field(description="torch.compile's mode, passed as written (reduce-overhead adds CUDA "
              "graphs; max-autotune benchmarks kernel choices and compiles much longer)."),
    ] = "default"
    dynamic: Annotated[
        bool | None,
        Field(description="Shape specialisation. None (torch's default): static first, dynamic "
              "for a dimension once it changes (one recompile). false: every new shape compiles "
              "again. true: dynamic from the start."),
    ] = None
    fullgraph: Annotated[
        bool,
        Field(description="Fail on the first graph break instead of splitting the graph and "
              "running the rest eagerly: each compiled unit must be one graph."),
    ] = False
    backend: Annotated[
        Literal["inductor", "aot_eager", "eager", "tpu"],
        Field(description="torch.compile backend. inductor generates kernels (Triton on GPU, C++ "
              "on CPU, which needs a C++ compiler); aot_eager and eager trace without generating "
              "code, for finding graph breaks and numerical differences; tpu is TorchTPU's XLA "
              "compiler, the one it supports on topology.device: tpu (docs/tpu.md)."),
    ] = "inductor"
    max_recompiles: Annotated[
        int,
        Field(ge=0, description="After the first two steps (which compile, and may compile once "
              "more when a guard changes), warn once when more than this many frames have been "
              "compiled again, naming the code."),
    ] = 0

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        """`compile: true` / `compile: false` mean enabled true / false, every other field default."""
        return {"enabled": value} if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _modes(self) -> Compile:
        if self.mode != "default" and self.backend != "inductor":
            raise rule_error(("compile.mode", f"{self.mode!r} is an inductor mode, not one of "
                              f"backend {self.backend!r}; use backend: inductor or mode: default"))
        return self

    def torch_kwargs(self) -> dict:
        """The arguments of torch.compile / nn.Module.compile besides the backend. `mode` is not
        among them: it configures inductor, so it travels inside the backend object
        (parallel/engine/model/compile.py), and torch.compile would hand it to a callable backend as a
        keyword that backend does not take."""
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic}


def device_problems(spec) -> list[tuple[str, str]]:
    """compile.backend against topology.device: TorchTPU registers its compiler, `tpu`, and raises
    on inductor for TPU tensors (torch_tpu 0.2.0: experimental, its issue #4300); the tpu compiler
    exists only where TorchTPU runs."""
    c, device = spec.compile, spec.topology.device
    if c.backend == "tpu" and device != "tpu":
        return [("compile.backend", f"'tpu' with topology.device: {device}: it is TorchTPU's "
                 "compiler, for its tpu device; set topology.device: tpu, or compile.backend: "
                 "inductor")]
    if c.enabled and device == "tpu" and c.backend == "inductor":
        return [("compile.backend", "'inductor' with topology.device: tpu: torch_tpu 0.2.0 "
                 "raises on inductor for TPU tensors (experimental there); use compile.backend: "
                 "tpu, its XLA compiler")]
    return []
