"""Spec fuzzing (hypothesis): random dicts shaped like specs, random values in real fields, random YAML
documents and random --set overrides never raise anything but SpecError, and every problem names a
field path (or the file) with a message. The number of cases that ran is recorded for
docs/reliability.md."""

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import record

from parallel.spec.model import Spec
from parallel.spec.io import SpecError, load_spec

FIELDS = sorted(Spec.model_fields)
SECTIONS = {name: sorted(f.annotation.model_fields) for name, f in Spec.model_fields.items()
            if hasattr(f.annotation, "model_fields")}
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["full", "bf16", "fsdp", "deepspeed",
                                                           "xla_fsdp", "auto", "none", "params"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)


@st.composite
def spec_like(draw):
    data = {}
    for name in draw(st.lists(st.sampled_from(FIELDS + ["bogus", "shards"]), max_size=6)):
        if name in SECTIONS and draw(st.booleans()):
            keys = draw(st.lists(st.sampled_from(SECTIONS[name] + ["nope"]), max_size=3))
            data[name] = {k: draw(values) for k in keys}
        else:
            data[name] = draw(values)
    return data


COUNT = {"dicts": 0, "yaml": 0, "overrides": 0}
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def _record_counts():
    """The cases that ran (each fuzz test fails on any exception that is not a SpecError naming
    a field), for docs/reliability.md."""
    yield
    if sum(COUNT.values()):
        record("fuzzing", {"cases": dict(COUNT), "total": sum(COUNT.values())})


def check(source, overrides=()):
    try:
        load_spec(source, list(overrides))
    except SpecError as err:
        assert err.problems, "a SpecError with no problems"
        for path, message in err.problems:
            assert isinstance(path, str) and path.strip(), (path, message)
            assert isinstance(message, str) and message.strip(), (path, message)


@FUZZ
@given(spec_like())
def test_random_spec_dicts(data):
    COUNT["dicts"] += 1
    try:
        json.dumps(data, allow_nan=True)
    except (TypeError, ValueError):
        return
    check(data)


@FUZZ
@given(st.text(max_size=200) | spec_like().map(lambda d: yaml.safe_dump(d, allow_unicode=True)))
def test_random_yaml_documents(tmp_path_factory, text):
    COUNT["yaml"] += 1
    path = tmp_path_factory.mktemp("fuzz") / "spec.yaml"
    path.write_text(text)
    check(path)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FIELDS + [f"{s}.{k}" for s, ks in SECTIONS.items()
                                                    for k in ks] + ["x.y"]),
                          st.text(max_size=10)), max_size=4))
def test_random_overrides(pairs):
    COUNT["overrides"] += 1
    check({}, [f"{k}={v}" for k, v in pairs])


