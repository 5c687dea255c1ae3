"""The registry is the one source of backend facts: every capability a descriptor names is a spec
field the spec checks, every plan callable has the signature its Protocol states, and the cross-backend
case table (tests/distributed/matrix.py) holds every variant of every registered backend."""

import inspect
import sys
from pathlib import Path

import pytest

from parallel import registry
from parallel.descriptor import CommVolume, ModelStates
from parallel.spec.io import SpecError, load_spec
from parallel.spec.model import Spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import matrix  # noqa: E402 - the distributed tests' case table


def _field(model, dotted: str):
    for part in dotted.split("."):
        info = model.model_fields.get(part)
        if info is None:
            return None
        model = info.annotation
    return info


@pytest.mark.parametrize("descriptor", registry.descriptors(), ids=registry.names())
def test_every_capability_names_a_spec_field_the_spec_checks(descriptor):
    for name, values in descriptor.capabilities.unsupported.items():
        assert _field(Spec, name) is not None, f"{descriptor.name}: {name} is no spec field"
        for value, why in values.items():
            data = {"backend": descriptor.name}
            cursor = data
            *parents, leaf = name.split(".")
            for p in parents:
                cursor = cursor.setdefault(p, {})
            cursor[leaf] = value
            with pytest.raises(SpecError) as err:
                load_spec(data)
            assert name in str(err.value) and why.nearest in str(err.value), str(err.value)


@pytest.mark.parametrize("descriptor", registry.descriptors(), ids=registry.names())
def test_plan_callables_have_their_protocols_signatures(descriptor):
    for fn, protocol in ((descriptor.plan.model_states, ModelStates),
                         (descriptor.plan.comm, CommVolume)):
        wanted = list(inspect.signature(protocol.__call__).parameters)[1:]
        assert list(inspect.signature(fn).parameters) == wanted, (descriptor.name, fn)


def test_the_case_matrix_holds_every_registered_variant():
    names = {c.name for c in matrix.cases(every=True)}
    for d in registry.descriptors():
        assert set(d.variants or {d.name: {}}) <= names, d.name
    for c in matrix.cases(every=True):  # each runs here at 2 ranks' global batch
        spec = load_spec(c.spec)
        per_process = 2 if c.env.get("CPU_NUM_DEVICES") == "2" else 1
        assert spec.micro_batch_size * spec.world_size * per_process == 4, c


def test_a_registered_variant_joins_the_matrix():
    from dataclasses import replace

    fsdp = registry.get("fsdp")
    registry.register(replace(fsdp, name="fsdp_copy", variants={"copy2": {"fsdp": {"version": 2}}}))
    try:
        assert "copy2" in {c.name for c in matrix.cases(every=True)}
    finally:
        registry.unregister("fsdp_copy")
