"""Probability quantization (attnhub.quant): the rounding a kernel declares for the softmax
probabilities before P @ V, the reference's model of it, the bound the suite allows for it,
and the Capabilities field that declares it."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnhub import (
    AccuracyBound,
    AttentionSpec,
    BatchMetadata,
    Capabilities,
    LatentKVCache,
    MLASpec,
    PagedKVCache,
    reference,
    testing,
)
from attnhub.cli import capability_lines
from attnhub.errors import UnknownNameError
from attnhub.quant import (
    PROBABILITY_QUANTIZATIONS,
    ProbabilityQuantization,
    probability_error_bound,
    round_probabilities,
)

FP8 = torch.float8_e4m3fn
CAPS = Capabilities(
    devices=None,
    dtypes=frozenset({torch.bfloat16}),
    kv_cache_dtypes=frozenset({"auto", "fp8_e4m3"}),
    quantization_accuracy={"fp8_e4m3": AccuracyBound(0.3, 0.99)},
)


def test_every_scheme_is_described() -> None:
    assert set(PROBABILITY_QUANTIZATIONS) == {p.value for p in ProbabilityQuantization}


def test_rounding_scales_the_row_maximum_to_256_and_rounds_to_e4m3() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 1e-6], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    got = round_probabilities(p, "fp8_e4m3")
    unit = 0.5 / 256
    want = (p[0] / unit).float().to(FP8).double() * unit
    assert torch.equal(got[0], want)
    assert got[0, 0] == 0.5  # the maximum is exact
    assert got[0, 1] == 160 * unit  # 153.6: e4m3 steps by 16 in [128, 256)
    assert torch.equal(got[1], p[1])  # a row that sees nothing stays zero


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    scores=st.lists(st.floats(-30, 30), min_size=1, max_size=40),
    below=st.floats(0, 25),
    sink=st.one_of(st.none(), st.floats(-30, 30)),
)
def test_rounding_against_any_running_maximum_stays_within_the_bound(
    scores: list[float], below: float, sink: float | None
) -> None:
    """A kernel rounds ``2**8 * exp(s - m_t)`` against a running maximum ``m_t`` <= the row's
    maximum and normalizes by the unrounded sum (a sink's share included): however far
    ``m_t`` lags, each probability moves by at most ``probability_error_bound``."""
    s = torch.tensor(scores, dtype=torch.float64)
    m = float(s.max())
    m_t = m - below
    denom = float(torch.exp(s - m).sum()) + (0.0 if sink is None else math.exp(sink - m))
    p = torch.exp(s - m) / denom
    scaled = 256.0 * torch.exp(s - m_t)
    here = s <= m_t  # the scores a tile with running maximum m_t holds
    rounded = scaled.float().to(FP8).double() / 256.0 * math.exp(m_t - m) / denom
    err = (rounded - p).abs()[here]
    bound = probability_error_bound(p, "fp8_e4m3")[here]
    assert bool((err <= bound * (1 + 1e-9) + 1e-300).all()), (err - bound).max()


def test_unknown_or_unbounded_declarations_are_typed_errors() -> None:
    with pytest.raises(UnknownNameError, match="'fp4'"):
        replace(CAPS, probability_quantization={"fp8_e4m3": "fp4"})
    with pytest.raises(UnknownNameError, match="not declare"):
        replace(CAPS, probability_quantization={"fp8_e5m2": "fp8_e4m3"})
    with pytest.raises(UnknownNameError, match="without an accuracy bound"):
        replace(CAPS, quantization_accuracy={}, probability_quantization={"fp8_e4m3": "fp8_e4m3"})


def test_declarations_show_in_the_summary_and_the_listing() -> None:
    caps = replace(CAPS, probability_quantization={"fp8_e4m3": "fp8_e4m3"})
    assert caps.summary()["probability_quantization"] == {"fp8_e4m3": "fp8_e4m3"}
    assert any("fp8_e4m3: fp8_e4m3" in str(line) for line in capability_lines(caps))
    assert testing.probability_rounding(CAPS, "fp8_e4m3") is None


def _step() -> tuple[torch.Tensor, PagedKVCache, BatchMetadata, AttentionSpec]:
    spec = AttentionSpec(
        num_heads=4,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.bfloat16,
        block_size=16,
        kv_cache_dtype="fp8_e4m3",
    )
    g = testing.generator(7)
    batch, num_blocks = testing.make_batch([1, 5], [300, 40], 16, seed=g)
    cache = PagedKVCache.for_spec(spec, num_blocks, "cpu")
    testing.fill_cache_random(cache, g)
    query = torch.randn(batch.num_actual_tokens, 4, 32, generator=g)
    return query, cache, batch, spec


def test_the_reference_maps_the_probabilities_before_p_v_and_keeps_the_lse() -> None:
    query, cache, batch, spec = _step()
    plain, lse = reference.paged_attention(query, cache, batch, spec)
    same, lse_same = reference.paged_attention(query, cache, batch, spec, probabilities=lambda p: p)
    assert torch.equal(plain, same) and torch.equal(lse, lse_same)
    rounded_p = functools.partial(round_probabilities, scheme="fp8_e4m3")
    rounded, lse_rounded = reference.paged_attention(
        query, cache, batch, spec, probabilities=rounded_p
    )
    assert torch.equal(lse, lse_rounded)
    assert not torch.allclose(plain, rounded, atol=1e-4)


def test_the_allowance_covers_the_row_maximum_model() -> None:
    query, cache, batch, spec = _step()
    exact, _ = reference.paged_attention(query, cache, batch, spec)
    caps = replace(CAPS, probability_quantization={"fp8_e4m3": "fp8_e4m3"})
    model, _ = reference.paged_attention(
        query, cache, batch, spec, probabilities=testing.probability_rounding(caps, "fp8_e4m3")
    )
    allowance = testing.probability_allowance(query, cache, batch, spec, "fp8_e4m3")
    assert bool(((model - exact).abs() <= allowance).all())
    assert float(allowance.max()) < 0.1 * float(exact.abs().max()) + 0.2  # not vacuous


def test_the_unscaled_scheme_rounds_relative_to_a_maximum_of_one() -> None:
    """``fp8_e4m3_unscaled`` (FlashMLA's fp8 dense decode): the row maximum is 1, so small
    probabilities fall into e4m3's subnormals (steps of 2**-9 below 2**-6, 0 below 2**-10)."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.5 * 2.0**-8, 0.5 * 2.0**-12]], dtype=torch.float64)
    got = round_probabilities(p, "fp8_e4m3_unscaled")
    unit = 0.5  # the row maximum
    want = (p / unit).float().to(FP8).double() * unit
    assert torch.equal(got, want)
    assert got[0, 0] == 0.5 and got[0, 4] == 0.0  # exact maximum; 2**-12 of it flushes to 0
    assert got[0, 3] == unit * 2.0**-8  # a subnormal that is a multiple of 2**-9 stays
    scaled = round_probabilities(p, "fp8_e4m3")
    assert scaled[0, 4] != 0.0  # the 2**8 offset keeps it (the schemes differ)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    scores=st.lists(st.floats(-30, 30), min_size=1, max_size=40),
    below=st.floats(0, 25),
)
def test_the_unscaled_rounding_against_any_running_maximum_stays_within_its_bound(
    scores: list[float], below: float
) -> None:
    """As above for ``fp8_e4m3_unscaled``: ``exp(s - m_t)`` (at most 1) rounded to e4m3 against
    a running maximum ``m_t`` <= the row's, normalized by the unrounded sum."""
    s = torch.tensor(scores, dtype=torch.float64)
    m = float(s.max())
    m_t = m - below
    denom = float(torch.exp(s - m).sum())
    p = torch.exp(s - m) / denom
    here = s <= m_t
    rounded = torch.exp(s - m_t).float().to(FP8).double() * math.exp(m_t - m) / denom
    err = (rounded - p).abs()[here]
    bound = probability_error_bound(p, "fp8_e4m3_unscaled")[here]
    assert bool((err <= bound * (1 + 1e-9) + 1e-300).all()), (err - bound).max()
    # the scaled scheme's tighter subnormal term does not cover this rounding in general
    assert bool(
        (
            probability_error_bound(p, "fp8_e4m3")
            <= probability_error_bound(p, "fp8_e4m3_unscaled")
        ).all()
    )


def test_the_mla_allowance_covers_the_row_maximum_model_of_the_absorbed_form() -> None:
    """``testing.mla_probability_allowance``: per element, what rounding the probabilities
    (``fp8_e4m3_unscaled``) before ``P @ kv_c`` can change, over a step of an fp8 latent cache."""
    spec = MLASpec(
        num_heads=4,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        dtype=torch.bfloat16,
        block_size=16,
        kv_cache_dtype="fp8_e4m3",
    )
    g = testing.generator(21)
    batch, nb = testing.make_batch([1, 3, 1], [40, 19, 3], 16, seed=g)
    cache = LatentKVCache.for_spec(spec, nb, "cpu")
    testing.fill_latent_cache_random(cache, g)
    query = testing.random_mla_query(spec, batch.num_tokens, g).double()
    exact, _ = reference.paged_mla_absorbed(query, cache, batch, spec)
    rounding = functools.partial(round_probabilities, scheme="fp8_e4m3_unscaled")
    qsl = batch.query_start_loc_cpu.tolist()
    model = []
    for r in range(batch.num_reqs):
        kv_c, k_pe = reference.read_latent_sequence(
            cache, batch.block_table[r], int(batch.seq_lens_cpu[r])
        )
        out, _ = reference.attention(
            query[qsl[r] : qsl[r + 1]],
            torch.cat([kv_c, k_pe], dim=-1)[:, None, :],
            kv_c[:, None, :],
            scale=spec.scale,
            probabilities=rounding,
        )
        model.append(out)
    rounded = torch.cat(model)
    allowance = testing.mla_probability_allowance(query, cache, batch, spec, "fp8_e4m3_unscaled")
    assert allowance.shape == exact.shape
    assert bool(((rounded - exact).abs() <= allowance).all())
    assert float((rounded - exact).abs().max()) > 0  # the rounding shows
    assert float(allowance.max()) < 0.1 * float(exact.abs().max()) + 0.2  # not vacuous
