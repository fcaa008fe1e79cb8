"""AttentionSpec validates and normalizes itself on construction; errors name the bad value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnhub import AttentionSpec, AttentionType
from attnhub.errors import InvalidSpecError


def spec(**kw: object) -> AttentionSpec:
    args: dict[str, object] = {"num_heads": 8, "num_kv_heads": 2, "head_size": 64}
    args.update(kw)
    return AttentionSpec(**args)  # type: ignore[arg-type]


BAD_SPECS = [
    pytest.param({"num_heads": 6, "num_kv_heads": 4}, "num_heads = 6", id="heads_not_divisible"),
    pytest.param({"head_size": 0}, "head_size = 0", id="head_size_zero"),
    pytest.param({"head_size": -64}, "head_size = -64", id="head_size_negative"),
    pytest.param({"num_heads": 0}, "num_heads = 0", id="num_heads_zero"),
    pytest.param({"num_kv_heads": 0}, "num_kv_heads = 0", id="num_kv_heads_zero"),
    pytest.param({"num_heads": True}, "num_heads = True", id="num_heads_bool"),
    pytest.param({"head_size": 64.0}, "head_size = 64.0", id="head_size_float"),
    pytest.param({"block_size": 16.0}, "block_size = 16.0", id="block_size_float"),
    pytest.param({"block_size": False}, "block_size = False", id="block_size_bool"),
    pytest.param({"kv_cache_dtype": "fp4"}, "'fp4'", id="kv_cache_dtype_unknown"),
    pytest.param(
        {"kv_cache_dtype": torch.float8_e4m3fn}, "float8_e4m3fn", id="kv_cache_dtype_torch_dtype"
    ),
    pytest.param({"dtype": torch.float64}, "torch.float64", id="dtype_float64"),
    pytest.param({"dtype": torch.int8}, "torch.int8", id="dtype_int8"),
    pytest.param({"dtype": "bfloat16"}, "'bfloat16'", id="dtype_string"),
    pytest.param({"scale": 0.0}, "scale = 0.0", id="scale_zero"),
    pytest.param({"scale": -0.1}, "scale = -0.1", id="scale_negative"),
    pytest.param({"scale": float("nan")}, "scale = nan", id="scale_nan"),
    pytest.param({"scale": float("inf")}, "scale = inf", id="scale_inf"),
    pytest.param({"scale": True}, "scale = True", id="scale_bool"),
    pytest.param({"scale": "0.125"}, "scale = '0.125'", id="scale_string"),
    pytest.param({"logits_soft_cap": -5.0}, "logits_soft_cap = -5.0", id="softcap_negative"),
    pytest.param({"logits_soft_cap": float("inf")}, "logits_soft_cap = inf", id="softcap_inf"),
    pytest.param({"attn_type": "cross"}, "'cross'", id="attn_type_unknown"),
    pytest.param({"sliding_window": 0}, "sliding_window = 0", id="sliding_window_zero"),
    pytest.param({"sliding_window": 4.0}, "4.0", id="sliding_window_float"),
    pytest.param({"sliding_window": True}, "True", id="sliding_window_bool"),
    pytest.param({"window": (-2, 0)}, "(-2, 0)", id="window_below_minus_one"),
    pytest.param({"window": (3,)}, "(3,)", id="window_not_a_pair"),
    pytest.param({"window": "ab"}, "'ab'", id="window_string"),
    pytest.param(
        {"sliding_window": 4, "window": (2, 0)}, "sliding_window = 4", id="window_disagrees"
    ),
    pytest.param(
        {"sliding_window": 4, "window": (3, 3)}, "(3, 3)", id="causal_window_right_positive"
    ),
    pytest.param({"window": (3, 2)}, "(3, 2)", id="causal_window_right_gt_0"),
    pytest.param(
        {"attn_type": "encoder_only", "sliding_window": 4, "window": (3, 0)},
        "(3, 0)",
        id="encoder_window_disagrees",
    ),
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_SPECS)
def test_invalid_spec_raises_invalid_spec_error_naming_the_value(
    kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidSpecError) as info:
        spec(**kwargs)
    assert named in str(info.value)


def test_invalid_spec_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        spec(head_size=0)


def test_default_scale_is_inverse_sqrt_head_size() -> None:
    s = spec(head_size=128)
    assert s.scale == pytest.approx(128**-0.5, rel=0, abs=1e-15)
    assert isinstance(s.scale, float)


def test_explicit_int_scale_becomes_float() -> None:
    s = spec(scale=1)
    assert s.scale == 1.0 and isinstance(s.scale, float)


def test_fp8_alias_means_fp8_e4m3() -> None:
    assert spec(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert spec(kv_cache_dtype="fp8_e4m3fn").kv_cache_dtype == "fp8_e4m3"


def test_attn_type_string_becomes_enum() -> None:
    s = spec(attn_type="encoder_only")
    assert s.attn_type is AttentionType.ENCODER_ONLY
    assert not s.causal


def test_only_decoder_is_causal() -> None:
    assert spec().causal
    for t in ("encoder", "encoder_only", "encoder_decoder"):
        assert not spec(attn_type=t).causal


def test_decoder_sliding_window_w_is_window_w_minus_1_and_0() -> None:
    s = spec(sliding_window=4)
    assert s.window == (3, 0)
    assert s.sliding_window == 4
    assert s.has_window


def test_decoder_window_pair_derives_sliding_window() -> None:
    s = spec(window=(3, 0))
    assert s.window == (3, 0)
    assert s.sliding_window == 4


def test_decoder_window_right_minus_one_normalizes_to_zero() -> None:
    assert spec(window=(3, -1)).window == (3, 0)


def test_agreeing_window_and_sliding_window_are_accepted() -> None:
    s = spec(sliding_window=4, window=(3, 0))
    assert (s.window, s.sliding_window) == ((3, 0), 4)


@pytest.mark.parametrize("attn_type", ["encoder_only", "encoder", "encoder_decoder"])
def test_non_causal_sliding_window_w_is_symmetric(attn_type: str) -> None:
    s = spec(attn_type=attn_type, sliding_window=4)
    assert s.window == (3, 3)
    assert s.sliding_window == 4


def test_non_causal_asymmetric_window_has_no_sliding_window() -> None:
    s = spec(attn_type="encoder_only", window=(2, 5))
    assert s.window == (2, 5)
    assert s.sliding_window is None


@pytest.mark.parametrize("window", [None, (-1, -1), (-1, 0)], ids=str)
def test_no_window_normalizes_to_minus_one_pair(window: tuple[int, int] | None) -> None:
    s = spec(window=window)
    assert s.window == (-1, -1)
    assert s.sliding_window is None
    assert not s.has_window


def test_softcap_zero_means_no_softcap() -> None:
    assert spec(logits_soft_cap=0).logits_soft_cap is None
    assert "softcap" not in spec(logits_soft_cap=0).features()


def test_features_lists_what_the_spec_uses() -> None:
    s = spec(sliding_window=8, logits_soft_cap=30, use_alibi=True, use_sinks=True)
    assert s.features() == {"sliding_window", "softcap", "alibi", "sinks"}
    assert spec().features() == set()


def test_num_queries_per_kv_is_the_gqa_group() -> None:
    assert spec(num_heads=32, num_kv_heads=8).num_queries_per_kv == 4


def test_spec_is_frozen() -> None:
    s = spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_heads = 16  # type: ignore[misc]


def test_equal_specs_are_equal_and_hashable() -> None:
    assert spec(kv_cache_dtype="fp8") == spec(kv_cache_dtype="fp8_e4m3")
    assert len({spec(), spec()}) == 1


def test_replace_adds_a_sliding_window_to_a_windowless_spec():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_size=8)
    windowed = dataclasses.replace(spec, sliding_window=128)
    assert windowed.window == (127, 0)
    assert windowed.sliding_window == 128
