"""attnhub.testing's MLA helpers: a randomly filled latent cache holds finite data at every slot
in its storage format (fp8 with the scale it was quantized with), and the random weights,
latents and queries drive the float64 reference's two forms to the same answer."""

from __future__ import annotations

import pytest
import torch

from attnhub import reference, testing
from attnhub.errors import InvalidInputError
from attnhub.mla import LatentKVCache, MLASpec

F64 = torch.float64


def spec(**kw: object) -> MLASpec:
    args: dict = dict(num_heads=3, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12)
    args.update(kw)
    return MLASpec(**args, v_head_dim=10, block_size=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize(("dtype", "kv"), [(torch.float32, "auto"), (torch.bfloat16, "fp8")])
def test_fill_latent_cache_random_fills_every_slot_finite(
    layout: str, dtype: torch.dtype, kv: str
) -> None:
    s = spec(dtype=dtype, kv_cache_dtype=kv)
    cache = LatentKVCache.for_spec(s, 5, layout=layout)
    testing.fill_latent_cache_random(cache, testing.generator(1))
    for name, plane in cache.planes().items():
        x = plane.float()
        assert torch.isfinite(x).all(), name
        # every slot written (zero-filled before): no all-zero row
        assert (x.reshape(-1, x.shape[-1]).abs().sum(-1) > 0).all(), name
    if kv == "fp8":
        assert cache.scale is not None
        assert cache.scale == torch.tensor(testing.FP8_LATENT_TEST_SCALE, dtype=torch.float32)
        # the stored values dequantize to the clamped N(0, 1) draws (+-4, the scale's rounding)
        assert float(cache.kv_c.float().abs().max()) * float(cache.scale) <= 4.0 * (1 + 1e-6)
    other = LatentKVCache.for_spec(s, 5, layout=layout)
    testing.fill_latent_cache_random(other, testing.generator(1))
    assert cache.equal(other)  # a seed gives the same cache


def test_random_weights_and_queries_give_the_forms_one_answer() -> None:
    s = spec(dtype=torch.float32)
    g = testing.generator(4)
    batch, nb = testing.make_batch([1, 3], [6, 3], s.block_size, seed=g)
    cache = LatentKVCache.for_spec(s, nb + 1)
    testing.fill_latent_cache_random(cache, g)  # stale everywhere
    kv_c, k_pe = testing.random_latent_kv(s, batch.num_actual_tokens, g)
    assert kv_c.shape == (4, 16) and k_pe.shape == (4, 8) and kv_c.dtype == torch.float32
    reference.write_latent_kv(cache, kv_c, k_pe, batch.slot_mapping[: batch.num_actual_tokens])
    w_uk, w_uv = testing.random_mla_weights(s, g)
    assert w_uk.shape == (16, 3, 12) and w_uv.shape == (16, 3, 10)
    q = testing.random_mla_query(s, batch.num_actual_tokens, g, form="expanded").to(F64)
    assert q.shape == (4, 3, s.qk_head_dim)
    expanded, lse_e = reference.paged_mla_expanded(q, cache, batch, s, w_uk, w_uv)
    q_nope, q_pe = q[..., : s.qk_nope_head_dim], q[..., s.qk_nope_head_dim :]
    absorbed = torch.cat([reference.absorb_query(q_nope, w_uk), q_pe], -1)
    latent, lse_a = reference.paged_mla_absorbed(absorbed, cache, batch, s)
    torch.testing.assert_close(reference.mla_output(latent, w_uv), expanded, atol=1e-9, rtol=0)
    torch.testing.assert_close(lse_a, lse_e, atol=1e-9, rtol=0)
    assert testing.random_mla_query(s, 2, g).shape == (2, 3, s.latent_size)
    with pytest.raises(InvalidInputError, match="form = 'latent'"):
        testing.random_mla_query(s, 2, g, form="latent")


def test_random_mla_step_is_a_step_of_the_backends_spec_and_layout_drawn_from_its_seed() -> None:
    import attnhub

    backend = attnhub.get_backend("torch")(spec(dtype=torch.float32), "cpu")
    requests = [(1, 9), (3, 3), (2, 7)]
    step = testing.random_mla_step(backend, requests, seed=4, padding=3)
    batch = step.batch
    assert batch.query_start_loc.tolist() == [0, 1, 4, 6] and batch.seq_lens.tolist() == [9, 3, 7]
    assert batch.num_actual_tokens == 6 and batch.num_tokens == 9
    assert step.cache.layout in backend.capabilities.mla.layouts
    assert step.query.shape == (9, 3, 24) and step.kv_c.shape == (9, 16)
    assert step.k_pe.shape == (9, 8) and step.query.dtype == torch.float32
    # the cache covers every block the table names, and is filled (no zero plane)
    assert int(batch.block_table.max()) < step.cache.num_blocks
    assert bool(step.cache.kv_c.abs().sum() > 0) and bool(step.cache.k_pe.abs().sum() > 0)
    again = testing.random_mla_step(backend, requests, seed=4, padding=3)
    assert torch.equal(again.query, step.query) and again.cache.equal(step.cache)
    other = testing.random_mla_step(backend, requests, seed=5, padding=3)
    assert not torch.equal(other.query, step.query)
    # the reference runs the step (the helper's shapes are what it takes)
    out, _ = reference.paged_mla_absorbed(step.query, step.cache, batch, backend.spec)
    assert out.shape == (6, 3, 16)
