"""Query quantization schemes (attnhub.quant), the Capabilities fields that declare them and
the accuracy bound of quantized caches, and the testing helpers that use them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from attnhub import AccuracyBound, Capabilities, testing
from attnhub.capabilities import STATIC_SCALES_COVER
from attnhub.cli import capability_lines
from attnhub.errors import InvalidInputError, UnknownNameError
from attnhub.quant import (
    QUERY_QUANTIZATIONS,
    QueryQuantization,
    quantize_fp8,
    simulate_query_quantization,
)

CAPS = Capabilities(
    devices=None,
    dtypes=frozenset({torch.bfloat16}),
    kv_cache_dtypes=frozenset({"auto", "int8", "fp8_e4m3"}),
)


def test_every_scheme_is_described() -> None:
    assert set(QUERY_QUANTIZATIONS) == {q.value for q in QueryQuantization}


def test_int8_per_token_head_is_amax_over_127_per_token_and_head() -> None:
    q = torch.tensor([[[1.0, -2.0, 0.5, 127.0 / 64]], [[0.0, 0.0, 0.0, 0.0]]])  # [2, 1, 4]
    got = simulate_query_quantization(q, "int8_per_token_head")
    assert got.dtype == torch.float64
    scale = 2.0 / 127  # row 0: amax 2
    want = torch.round(q[0, 0].double() / torch.tensor(scale, dtype=torch.float32).double())
    assert torch.equal(got[0, 0], want * torch.tensor(scale, dtype=torch.float32).double())
    assert torch.equal(got[1], torch.zeros(1, 4, dtype=torch.float64))  # all zero: zeros


def test_int8_per_token_head_rounds_half_to_even() -> None:
    # amax 127 gives scale exactly 1: 2.5 -> 2, 3.5 -> 4, -0.5 -> -0
    q = torch.tensor([[[127.0, 2.5, 3.5, -0.5]]])
    got = simulate_query_quantization(q, QueryQuantization.INT8_PER_TOKEN_HEAD)
    assert got[0, 0].tolist() == [127.0, 2.0, 4.0, -0.0]


def test_int8_per_token_head_scales_each_head_on_its_own() -> None:
    g = testing.generator(1)
    q = torch.randn(3, 4, 64, generator=g)
    q[:, 1] *= 100  # one head much larger: the others keep their own resolution
    got = simulate_query_quantization(q, "int8_per_token_head")
    err = (got - q.double()).abs()
    step = q.abs().amax(-1, keepdim=True).double() / 127
    assert bool((err <= step / 2 + 1e-12).all())
    assert float(err[:, 0].max()) < float(err[:, 1].max()) / 10


def test_fp8_static_stores_fp8_of_x_over_the_scale() -> None:
    q = torch.tensor([[[1.0, 1000.0, -0.3, 1e-6]]])
    got = simulate_query_quantization(q, "fp8_static", scale=0.5)
    want = quantize_fp8(q, 0.5).double() * 0.5
    assert torch.equal(got, want)
    assert float(got[0, 0, 1]) == 448 * 0.5  # saturated


def test_unknown_scheme_is_a_typed_error_naming_it() -> None:
    with pytest.raises(UnknownNameError, match="'int4'"):
        simulate_query_quantization(torch.zeros(1, 1, 4), "int4")


def test_a_query_of_the_wrong_rank_is_refused() -> None:
    with pytest.raises(InvalidInputError, match=r"\(2, 4\)"):
        simulate_query_quantization(torch.zeros(2, 4), "int8_per_token_head")


def test_capabilities_default_to_no_query_quantization() -> None:
    assert CAPS.query_quantization == {} and CAPS.quantization_accuracy == {}
    q = torch.randn(2, 2, 8)
    assert testing.quantized_query(q, CAPS, "int8") is q


def test_declared_query_quantization_is_applied_by_the_testing_helper() -> None:
    caps = replace(CAPS, query_quantization={"int8": "int8_per_token_head"})
    q = torch.randn(2, 2, 8, generator=testing.generator(2))
    assert torch.equal(
        testing.quantized_query(q, caps, "int8"),
        simulate_query_quantization(q, "int8_per_token_head"),
    )
    assert testing.quantized_query(q, caps, "auto") is q


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        (dict(query_quantization={"int8": "int4"}), "'int4'"),
        (dict(query_quantization={"int9": "int8_per_token_head"}), "'int9'"),
        (dict(query_quantization={"fp8": "fp8_static"}), "'fp8'"),  # alias, not canonical
        (dict(query_quantization={"fp8_e5m2": "fp8_static"}), "do not declare"),
        (dict(quantization_accuracy={"auto": AccuracyBound(0.1, 0.99)}), "quantizes nothing"),
        (dict(quantization_accuracy={"int9": AccuracyBound(0.1, 0.99)}), "'int9'"),
    ],
)
def test_unknown_names_in_the_declaration_are_typed_errors(
    changes: dict[str, object], words: str
) -> None:
    with pytest.raises(UnknownNameError, match=words):
        replace(CAPS, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("max_abs", "cos"), [(0.0, 0.99), (math.inf, 0.99), (math.nan, 0.99), (0.1, 0.0), (0.1, 1.5)]
)
def test_accuracy_bounds_must_be_meaningful(max_abs: float, cos: float) -> None:
    with pytest.raises(InvalidInputError, match="AccuracyBound"):
        AccuracyBound(max_abs, cos)


def test_accuracy_bound_lookup_names_what_is_declared() -> None:
    caps = replace(CAPS, quantization_accuracy={"int8": AccuracyBound(0.05, 0.999)})
    assert caps.accuracy_bound("int8") == AccuracyBound(0.05, 0.999)
    with pytest.raises(UnknownNameError, match=r"'fp8_e4m3'.*declared: int8"):
        caps.accuracy_bound("fp8_e4m3")


def test_declarations_show_in_the_summary_and_the_listing() -> None:
    caps = replace(
        CAPS,
        query_quantization={"int8": "int8_per_token_head"},
        quantization_accuracy={"int8": AccuracyBound(0.05, 0.999)},
    )
    summary = caps.summary()
    assert summary["query_quantization"] == {"int8": "int8_per_token_head"}
    assert summary["quantization_accuracy"] == {
        "int8": {"max_abs_error": 0.05, "min_cosine": 0.999, "condition": STATIC_SCALES_COVER}
    }
    lines = dict(capability_lines(caps))
    assert lines["query quantized"] == "int8: int8_per_token_head"
    assert lines["quant accuracy"].startswith("int8 0.05/0.999")


def test_accuracy_is_max_abs_error_and_min_cosine_per_token() -> None:
    e = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]], [[0.0, 0.0]]], dtype=torch.float64)
    a = e.clone()
    a[1, 0, 0] = 2.0  # token 1 at 45 degrees: cosine 1/sqrt(2)... of (2, 2) vs (0, 2)
    err, cos = testing.accuracy(a, e)
    assert err == 2.0
    assert cos == pytest.approx(1 / math.sqrt(2))
    assert testing.accuracy(e, e) == (0.0, 1.0)  # the all-zero token counts 1
    nan = a.clone()
    nan[0, 0, 0] = math.nan
    assert testing.accuracy(nan, e) == (math.inf, -1.0)


def test_accuracy_mismatch_says_what_was_measured_and_where() -> None:
    batch, _ = testing.make_batch([2, 1], [2, 5], 4)
    e = torch.randn(3, 2, 8, generator=testing.generator(3), dtype=torch.float64)
    a = e.clone()
    assert testing.accuracy_mismatch(a, e, AccuracyBound(0.01, 0.999), batch) is None
    a[2, 1, 3] += 0.5
    why = testing.accuracy_mismatch(a, e, AccuracyBound(0.01, 0.999), batch)
    assert why is not None
    assert "max abs error 0.5" in why and "declared bound 0.01" in why
    assert "token 2 (request 1" in why
    assert testing.accuracy_mismatch(a, e, AccuracyBound(0.6, 0.9), batch) is None
