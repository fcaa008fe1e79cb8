"""The float64 MLA reference: its absorbed and expanded forms agree on random weights (output and
LSE), both reproduce the independently computed golden cases (``tests/data/mla_golden.json``,
from ``tests/data/make_mla_golden.py``), directly and through a paged latent cache, and the
absorbed form takes the expanded form's scale."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnhub import reference
from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.testing import generator, make_batch, used_slots

F64 = torch.float64
GOLDEN = Path(__file__).resolve().parent / "data" / "mla_golden.json"
ATOL = 1e-9


def _load() -> dict:
    if not GOLDEN.is_file():
        raise FileNotFoundError(
            f"golden data missing: {GOLDEN} is part of the repo (regenerate with "
            "tests/data/make_mla_golden.py)"
        )
    return json.loads(GOLDEN.read_text())


GOLD = _load()


def t64(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def spec_of(case: dict, **kw: object) -> MLASpec:
    return MLASpec(
        num_heads=case["num_heads"],
        kv_lora_rank=case["kv_lora_rank"],
        qk_rope_head_dim=case["qk_rope_head_dim"],
        qk_nope_head_dim=case["qk_nope_head_dim"],
        v_head_dim=case["v_head_dim"],
        dtype=torch.float32,
        scale=case["scale"],
        **kw,  # type: ignore[arg-type]
    )


def queries(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(expanded query [q, H, P + R], absorbed query [q, H, L + R]) of a case."""
    q_nope, q_pe = t64(case["q_nope"]), t64(case["q_pe"])
    absorbed = torch.cat([reference.absorb_query(q_nope, t64(case["w_uk"])), q_pe], dim=-1)
    return torch.cat([q_nope, q_pe], dim=-1), absorbed


# --- golden cases ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", GOLD["cases"], ids=lambda c: c["name"])
def test_expanded_form_reproduces_golden_output_and_lse(case: dict) -> None:
    q, _ = queries(case)
    out, lse = reference.mla_expanded(
        q,
        t64(case["kv_c"]),
        t64(case["k_pe"]),
        t64(case["w_uk"]),
        t64(case["w_uv"]),
        scale=case["scale"],
    )
    torch.testing.assert_close(out, t64(case["expected_output"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, t64(case["expected_lse"]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", GOLD["cases"], ids=lambda c: c["name"])
def test_absorbed_form_reproduces_golden_latent_output_and_lse(case: dict) -> None:
    _, q = queries(case)
    out, lse = reference.mla_absorbed(q, t64(case["kv_c"]), t64(case["k_pe"]), scale=case["scale"])
    torch.testing.assert_close(out, t64(case["expected_latent_output"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, t64(case["expected_lse"]), atol=ATOL, rtol=0)
    projected = reference.mla_output(out, t64(case["w_uv"]))
    torch.testing.assert_close(projected, t64(case["expected_output"]), atol=ATOL, rtol=0)


def golden_in_cache(case: dict, layout: str) -> tuple[MLASpec, LatentKVCache, BatchMetadata]:
    """The case's sequence in a float32 latent cache (its inputs are exact there) of 2-slot
    blocks in shuffled order, every other slot holding stale random data."""
    spec = spec_of(case, block_size=2)
    batch, nb = make_batch([case["query_len"]], [case["seq_len"]], 2, seed=7)
    cache = LatentKVCache.for_spec(spec, nb, layout=layout)
    g = generator(3)
    stale = torch.arange(cache.num_slots)
    n = stale.numel()
    reference.write_latent_kv(
        cache, torch.randn(n, spec.kv_lora_rank, generator=g), torch.randn(n, 2, generator=g), stale
    )
    reference.write_latent_kv(cache, t64(case["kv_c"]), t64(case["k_pe"]), used_slots(batch))
    return spec, cache, batch


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("case", GOLD["cases"], ids=lambda c: c["name"])
def test_paged_forms_reproduce_golden_through_a_shuffled_latent_cache(
    case: dict, layout: str
) -> None:
    spec, cache, batch = golden_in_cache(case, layout)
    q, q_absorbed = queries(case)
    out, lse = reference.paged_mla_expanded(
        q, cache, batch, spec, t64(case["w_uk"]), t64(case["w_uv"])
    )
    torch.testing.assert_close(out, t64(case["expected_output"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(lse, t64(case["expected_lse"]), atol=ATOL, rtol=0)
    latent, lse_a = reference.paged_mla_absorbed(q_absorbed, cache, batch, spec)
    torch.testing.assert_close(latent, t64(case["expected_latent_output"]), atol=ATOL, rtol=0)
    torch.testing.assert_close(lse_a, t64(case["expected_lse"]), atol=ATOL, rtol=0)


def test_golden_file_covers_decode_chunked_prefill_and_a_given_scale() -> None:
    names = {c["name"] for c in GOLD["cases"]}
    assert {"decode", "chunked_prefill", "prefill", "given_scale"} <= names


# --- the two forms agree ----------------------------------------------------------------------

L, R, P, V, H = 16, 8, 12, 10, 4


def random_step(
    spec: MLASpec, layout: str, seed: int
) -> tuple[LatentKVCache, BatchMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixed step (decode, chunked prefill with context, prefill, padding rows) over a
    shuffled latent cache filled at every slot; the query parts and weights, float64."""
    g = generator(seed)
    batch, nb = make_batch([1, 4, 1, 6], [9, 11, 1, 6], spec.block_size, seed=g, num_tokens=14)
    cache = LatentKVCache.for_spec(spec, nb, layout=layout)
    if cache.scale is not None:
        cache.scale.fill_(0.02)
    n = cache.num_slots
    kv_c = torch.randn(n, L, generator=g).to(spec.dtype)
    k_pe = torch.randn(n, R, generator=g).to(spec.dtype)
    reference.write_latent_kv(cache, kv_c, k_pe, torch.arange(n))
    T = 14
    q_nope = torch.randn(T, H, P, generator=g, dtype=F64)
    q_pe = torch.randn(T, H, R, generator=g, dtype=F64)
    w_uk = torch.randn(L, H, P, generator=g, dtype=F64) / L**0.5
    w_uv = torch.randn(L, H, V, generator=g, dtype=F64) / L**0.5
    return cache, batch, q_nope, q_pe, w_uk, w_uv


def both_forms(
    spec: MLASpec, layout: str, seed: int, absorbed_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cache, batch, q_nope, q_pe, w_uk, w_uv = random_step(spec, layout, seed)
    expanded, lse_e = reference.paged_mla_expanded(
        torch.cat([q_nope, q_pe], -1), cache, batch, spec, w_uk, w_uv
    )
    absorbed_spec = spec if absorbed_scale is None else replace(spec, scale=absorbed_scale)
    q = torch.cat([reference.absorb_query(q_nope, w_uk), q_pe], -1)
    latent, lse_a = reference.paged_mla_absorbed(q, cache, batch, absorbed_spec)
    return reference.mla_output(latent, w_uv), lse_a, expanded, lse_e


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize(
    ("dtype", "kv"),
    [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "fp8_e4m3")],
)
def test_absorbed_and_expanded_forms_agree_on_random_weights(
    layout: str, dtype: torch.dtype, kv: str
) -> None:
    spec = MLASpec(
        num_heads=H,
        kv_lora_rank=L,
        qk_rope_head_dim=R,
        qk_nope_head_dim=P,
        v_head_dim=V,
        dtype=dtype,
        block_size=4,
        kv_cache_dtype=kv,
    )
    out_a, lse_a, out_e, lse_e = both_forms(spec, layout, seed=11)
    assert out_e.shape == (14 - 2, H, V)  # the 2 padding rows are not part of the step
    torch.testing.assert_close(out_a, out_e, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse_a, lse_e, atol=1e-10, rtol=1e-10)


def test_absorbed_form_with_the_latent_width_scale_does_not_agree() -> None:
    # The absorbed head is L + R wide, but its scores equal the expanded ones: taking
    # (L + R)^-0.5 instead of (P + R)^-0.5 is a different attention (a mutant the check catches).
    spec = MLASpec(
        num_heads=H, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=P, v_head_dim=V
    )
    out_a, lse_a, out_e, lse_e = both_forms(spec, "joint", seed=12, absorbed_scale=(L + R) ** -0.5)
    assert (out_a - out_e).abs().max() > 1e-3
    assert (lse_a - lse_e).abs().max() > 1e-3


def test_the_rope_part_moves_both_forms_alike() -> None:
    spec = MLASpec(
        num_heads=H, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=P, v_head_dim=V
    )
    cache, batch, q_nope, q_pe, w_uk, w_uv = random_step(spec, "split", seed=13)
    q = torch.cat([q_nope, q_pe], -1)
    before, _ = reference.paged_mla_expanded(q, cache, batch, spec, w_uk, w_uv)
    cache.k_pe.mul_(-1)  # the rope keys count: flipping them changes the attention
    after, _ = reference.paged_mla_expanded(q, cache, batch, spec, w_uk, w_uv)
    assert (before - after).abs().max() > 1e-3
    q_a = torch.cat([reference.absorb_query(q_nope, w_uk), q_pe], -1)
    latent, _ = reference.paged_mla_absorbed(q_a, cache, batch, spec)
    torch.testing.assert_close(reference.mla_output(latent, w_uv), after, atol=1e-10, rtol=1e-10)


# --- refusals ---------------------------------------------------------------------------------


def test_paged_forms_refuse_a_query_of_the_other_forms_width() -> None:
    case = GOLD["cases"][0]
    spec, cache, batch = golden_in_cache(case, "joint")
    q, q_absorbed = queries(case)
    with pytest.raises(InvalidInputError, match=r"\[num_tokens, 2, 6\] \(kv_lora_rank"):
        reference.paged_mla_absorbed(q, cache, batch, spec)
    with pytest.raises(InvalidInputError, match=r"\[num_tokens, 2, 5\] \(qk_nope_head_dim"):
        reference.paged_mla_expanded(
            q_absorbed, cache, batch, spec, t64(case["w_uk"]), t64(case["w_uv"])
        )


def test_paged_expanded_form_refuses_weights_of_the_wrong_shape() -> None:
    case = GOLD["cases"][0]
    spec, cache, batch = golden_in_cache(case, "joint")
    q, _ = queries(case)
    w_uk = t64(case["w_uk"])
    with pytest.raises(InvalidInputError, match=r"w_uv must be \[4, 2, 3\], got \[4, 2, 2\]"):
        reference.paged_mla_expanded(q, cache, batch, spec, w_uk, w_uk[..., :2])


# --- reading the cache ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_read_latent_sequence_dequantizes_fp8_by_the_cache_scale(layout: str) -> None:
    cache = LatentKVCache.allocate(3, 2, 4, 2, torch.bfloat16, layout=layout, kv_cache_dtype="fp8")
    assert cache.scale is not None
    cache.scale.fill_(0.25)
    # values exact in e4m3 once divided by 0.25: the read must give them back exactly
    kv_c = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.25, 0.0, -1.5, 2.0], [4.0, -4.0, 1.0, 0.75]])
    k_pe = torch.tensor([[-0.75, 1.25], [4.0, -4.0], [0.5, 2.5]])
    # positions 0, 1 in block 2, position 2 in block 1
    reference.write_latent_kv(cache, kv_c, k_pe, torch.tensor([4, 5, 2]))
    got_c, got_pe = reference.read_latent_sequence(cache, torch.tensor([2, 1]), 3)
    torch.testing.assert_close(got_c, kv_c.to(F64), atol=0, rtol=0)
    torch.testing.assert_close(got_pe, k_pe.to(F64), atol=0, rtol=0)
