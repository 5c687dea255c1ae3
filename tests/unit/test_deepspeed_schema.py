"""backends/deepspeed/config/schema.py's tables are what the installed DeepSpeed reads: a DeepSpeed upgrade
that adds, renames or drops a key fails here instead of drifting silently."""

import pytest

deepspeed = pytest.importorskip("deepspeed")

from backends.deepspeed.config import schema  # noqa: E402


class _Keys(list):
    def __contains__(self, key):
        _Recording.seen.add(key)
        return list.__contains__(self, key)


class _Recording(dict):
    """A config dict that records every top-level key DeepSpeed's parser looks at."""

    seen: set = set()

    def __getitem__(self, key):
        _Recording.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        _Recording.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        _Recording.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return _Keys(super().keys())

    def __copy__(self):
        return _Recording(self)


def test_top_level_keys_are_the_ones_deepspeeds_parser_reads():
    from deepspeed.runtime.config import DeepSpeedConfig

    _Recording.seen = set()
    DeepSpeedConfig(_Recording({"train_batch_size": 8}))
    # plus "sequence_parallel_size", read by DeepSpeedConfig.__init__ before parsing
    assert _Recording.seen | {"sequence_parallel_size"} == set(schema.TOP_LEVEL)


def test_zero_fields_aliases_and_deprecations_match_deepspeed():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    fields = DeepSpeedZeroConfig.model_fields
    deprecated = {n for n, f in fields.items() if (f.json_schema_extra or {}).get("deprecated")}
    assert set(fields) - deprecated == schema.ZERO_FIELDS
    assert deprecated == set(schema.ZERO_DEPRECATED)
    assert {f.alias: n for n, f in fields.items() if f.alias} == schema.ZERO_ALIASES
    assert set(DeepSpeedZeroOffloadOptimizerConfig.model_fields) == schema.OFFLOAD_FIELDS[
        "offload_optimizer"]
    assert set(DeepSpeedZeroOffloadParamConfig.model_fields) == schema.OFFLOAD_FIELDS["offload_param"]


def test_precision_fields_match_deepspeed():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    assert set(DeepSpeedFP16Config.model_fields) == schema.FP16_FIELDS
    assert set(DeepSpeedBF16Config.model_fields) == schema.BF16_FIELDS


def test_defaults_polyshard_writes_explicitly_are_deepspeeds():
    from deepspeed.runtime import constants
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    assert constants.GRADIENT_CLIPPING_DEFAULT == schema.DEFAULTS["gradient_clipping"]
    assert constants.COMMUNICATION_DATA_TYPE_DEFAULT is None
    assert DeepSpeedZeroOffloadOptimizerConfig().pin_memory is schema.DEFAULTS["pin_memory"]
    assert DeepSpeedZeroConfig().gather_16bit_weights_on_model_save is False


@pytest.mark.parametrize("zero,problem", [
    ({"offload_optimiser": {"device": "cpu"}}, "did you mean 'offload_optimizer'"),
    ({"overlap_com": True}, "did you mean 'overlap_comm'"),
    ({"gather_16bit_weights_on_model_save": True,
      "stage3_gather_16bit_weights_on_model_save": True}, "under two names"),
    ({"offload_param": {"device": "cpu", "pin_memroy": True}}, "did you mean 'pin_memory'"),
])
def test_what_deepspeed_refuses_is_refused(zero, problem):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(Exception):  # noqa: B017 - DeepSpeed's own parser is the oracle
        DeepSpeedZeroConfig(**{"stage": 3, **zero})
    found = schema.zero_key_problems({"stage": 3, **zero}, "zero_optimization")
    assert found and problem in found[0][1], found
