"""The int8 cache's static value scale clips values it does not cover; the opt-in
``attnhub.quant.ClipCounter`` counts them on every path that writes K/V, the decode-only
steps whose write rides on the paged kernel included (issue: a static value scale of 0.01-0.03
for unit-variance values lost accuracy without a sign)."""

from __future__ import annotations

import iluvatar_helpers as h
import pytest
import torch

from attnhub.quant import ClipCounter, calibrate_kv_scales

MIXED = [(1, 40), (3, 30), (20, 50)]
DECODES = [(1, 40), (1, 9), (1, 33)]


def _expected(st: h.Step) -> tuple[int, int]:
    """Values of this step's writes whose int8 value round(x / scale) is outside -128..127."""
    slots = st.batch.slot_mapping
    rows = st.value[: slots.shape[0]][slots >= 0].float()
    assert st.cache.value_scale is not None
    r = torch.round(rows / st.cache.value_scale)
    return int(((r > 127) | (r < -128)).sum()), rows.numel()


@pytest.mark.parametrize("requests", [DECODES, MIXED], ids=["decode_fused_write", "mixed"])
def test_values_a_small_static_scale_clips_are_counted(requests: list[tuple[int, int]]) -> None:
    st = h.step(requests, h.spec(kv_cache_dtype="int8"), padding=2)
    assert st.cache.value_scale is not None
    st.cache.value_scale.fill_(0.01)  # covers |x| <= 1.27: N(0, 1) values beyond it clip
    impl = st.backend.impl()
    counter = ClipCounter()
    counter.watch("layers.0", impl)
    meta = st.backend.metadata_builder().build(st.batch)
    assert meta.fused_write == (requests is DECODES)
    impl.forward(st.query, st.key, st.value, st.cache, meta)
    got = counter.counts()["layers.0"]
    assert (got.value_clipped, got.value_written) == _expected(st)
    assert got.value_clipped > 0
    assert (got.key_clipped, got.key_written) == (0, 0)  # keys: dynamic scales, never clipped


def test_calibrated_value_scales_clip_nothing() -> None:
    st = h.step(MIXED, h.spec(kv_cache_dtype="int8"), padding=2)
    assert st.cache.value_scale is not None
    _, value_scale = calibrate_kv_scales("int8", [st.key], [st.value])
    assert value_scale is not None
    st.cache.value_scale.copy_(value_scale)
    impl = st.backend.impl()
    counter = ClipCounter()
    counter.watch("layers.0", impl)
    impl.forward(
        st.query, st.key, st.value, st.cache, st.backend.metadata_builder().build(st.batch)
    )
    got = counter.counts()["layers.0"]
    assert got.value_clipped == 0 and got.value_written > 0
