"""Static scales of quantized caches: when the declared accuracy holds, how to calibrate scales
that make it hold, and the opt-in count of values a static scale clips (attnhub.quant).

A static scale (fp8's per-tensor scales, int8's per-channel value scale) stores x / scale
saturated at the format's largest value: a miscalibrated one clips, silently. The accuracy
bound states the condition; ``calibrate_kv_scales`` computes covering scales from samples;
``ClipCounter`` counts clipped values per layer on the device, read when asked.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attnhub_conformance.hostsync import HostSyncError, run_layer_guarded

from attnhub import AccuracyBound, AttentionSpec, kit
from attnhub.capabilities import STATIC_SCALES_COVER
from attnhub.errors import InvalidInputError, UnknownNameError
from attnhub.quant import (
    STATIC_LIMITS,
    ClipCount,
    ClipCounter,
    LayerClipCounter,
    calibrate_kv_scales,
    quantize_fp8,
    quantize_int8,
)
from attnhub.testing import generator, make_batch, random_qkv
from attnhub.torch_backend import TorchBackend

HKV, D = 2, 16


def _samples(n: int, seed: int, spread: float = 1.0) -> list[torch.Tensor]:
    g = generator(seed)
    return [torch.randn(7, HKV, D, generator=g) * spread for _ in range(n)]


# --- the condition --------------------------------------------------------------------------


def test_an_accuracy_bound_states_when_it_holds() -> None:
    bound = AccuracyBound(0.06, 0.9995)
    assert bound.condition == STATIC_SCALES_COVER
    assert "static scale covers the values" in bound.condition
    assert "calibrate_kv_scales" in bound.condition and "ClipCounter" in bound.condition


@pytest.mark.parametrize("condition", ["", "   ", None], ids=repr)
def test_an_accuracy_bound_without_a_condition_is_refused(condition: object) -> None:
    with pytest.raises(InvalidInputError, match="must say when the bound holds"):
        AccuracyBound(0.06, 0.9995, condition)  # type: ignore[arg-type]


# --- calibration ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_calibrated_scales_map_the_largest_sample_to_the_largest_stored_value(kv: str) -> None:
    keys, values = _samples(3, 0), _samples(3, 1, spread=3.0)
    key_scale, value_scale = calibrate_kv_scales(kv, keys, values)
    every_value = torch.cat(values).abs()
    assert value_scale is not None and value_scale.dtype == torch.float32
    if kv == "int8":  # values: static per (kv head, channel); keys: dynamic, none to calibrate
        assert key_scale is None
        assert value_scale.shape == (HKV, D)
        want = every_value.amax(dim=0) / 127
    else:  # per tensor, keys and values
        limit = STATIC_LIMITS[torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.float8_e5m2]
        assert key_scale is not None and key_scale.shape == ()
        assert torch.allclose(key_scale, torch.cat(keys).abs().amax() / limit)
        want = every_value.amax() / limit
    assert torch.allclose(value_scale, want)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_values_like_the_samples_are_never_clipped_with_calibrated_scales(kv: str) -> None:
    values = _samples(4, 2, spread=5.0)
    _, scale = calibrate_kv_scales(kv, _samples(1, 3), values)
    assert scale is not None
    x = torch.cat(values)
    if kv == "int8":
        stored = quantize_int8(x, scale)
        assert int(stored.abs().max()) <= 127
        assert torch.allclose(stored.float() * scale, x, atol=float(scale.max()) / 2 + 1e-6)
    else:
        stored = quantize_fp8(x, scale).float() * scale
        assert float((stored - x).abs().max()) <= float(x.abs().max()) * 2**-4


def test_a_margin_leaves_headroom_and_a_silent_channel_covers_one() -> None:
    values = _samples(2, 4)
    values[0][:, 1, 3] = 0
    values[1][:, 1, 3] = 0  # channel (1, 3) is zero in every sample
    _, plain = calibrate_kv_scales("int8", values, values)
    _, roomy = calibrate_kv_scales("int8", values, values, margin=2.0)
    assert plain is not None and roomy is not None
    assert torch.allclose(roomy, 2 * plain)
    assert float(plain[1, 3]) == pytest.approx(1 / 127)


def test_formats_without_static_scales_calibrate_to_none() -> None:
    s = _samples(1, 5)
    assert calibrate_kv_scales("auto", s, s) == (None, None)
    assert calibrate_kv_scales("int8_k", s, s) == (None, None)


@pytest.mark.parametrize(
    ("keys", "margin", "error", "named"),
    [
        ([], 1.0, InvalidInputError, "no sample activations"),
        ([torch.zeros(3, HKV)], 1.0, InvalidInputError, "keys[0] must be a float tensor"),
        ([torch.zeros(3, HKV, D, dtype=torch.int32)], 1.0, InvalidInputError, "torch.int32"),
        ([torch.zeros(3, HKV, D), torch.zeros(3, HKV, D + 1)], 1.0, InvalidInputError, "keys[1]"),
        ([torch.zeros(3, HKV, D)], 0.5, InvalidInputError, "margin = 0.5"),
    ],
)
def test_calibration_refuses_what_it_cannot_use(
    keys: list[torch.Tensor], margin: float, error: type[Exception], named: str
) -> None:
    with pytest.raises(error) as info:
        calibrate_kv_scales("fp8_e4m3", keys, _samples(1, 6), margin=margin)
    assert named in str(info.value)


def test_calibration_of_an_unknown_format_names_it() -> None:
    with pytest.raises(UnknownNameError, match="'int4'"):
        calibrate_kv_scales("int4", _samples(1, 0), _samples(1, 0))


# --- counting clipped values ------------------------------------------------------------------

SPEC = AttentionSpec(
    num_heads=4,
    num_kv_heads=HKV,
    head_size=D,
    dtype=torch.bfloat16,
    block_size=8,
    kv_cache_dtype="fp8_e4m3",
)


def _fp8_layer(key_scale: float, value_scale: float):  # type: ignore[no-untyped-def]
    backend = TorchBackend(SPEC)
    batch, nb = make_batch([1, 5, 1], [9, 12, 17], 8, seed=generator(0), num_tokens=9)
    cache = backend.allocate_kv_cache(nb)
    cache.key_scale.fill_(key_scale)  # type: ignore[union-attr]
    cache.value_scale.fill_(value_scale)  # type: ignore[union-attr]
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(1))
    return backend, batch, cache, q, k, v


def _expected_clipped(x: torch.Tensor, scale: float, slots: torch.Tensor) -> tuple[int, int]:
    rows = x[: slots.shape[0]][slots >= 0].float()
    return int(((rows / scale).abs() > 448).sum()), rows.numel()


def test_the_counter_counts_what_a_too_small_static_scale_clips_per_plane() -> None:
    backend, batch, cache, q, k, v = _fp8_layer(2 / 448, 1 / 448)  # covers |x| <= 2 and <= 1
    impl = backend.impl()
    counter = ClipCounter()
    counter.watch("layers.0", impl)
    impl.forward(q, k, v, cache, backend.metadata_builder().build(batch))
    got = counter.counts()["layers.0"]
    slots = batch.slot_mapping
    assert (got.key_clipped, got.key_written) == _expected_clipped(k, 2 / 448, slots)
    assert (got.value_clipped, got.value_written) == _expected_clipped(v, 1 / 448, slots)
    assert got.value_clipped > got.key_clipped > 0  # N(0, 1): some beyond 1, fewer beyond 2
    assert got.fraction == pytest.approx(got.clipped / (got.key_written + got.value_written))


def test_covering_scales_count_nothing_and_a_watched_layer_writes_the_same() -> None:
    backend, batch, cache, q, k, v = _fp8_layer(1.0, 1.0)
    plain, watched = backend.impl(), backend.impl()
    counter = ClipCounter()
    counter.watch("layers.1", watched)
    meta = backend.metadata_builder().build(batch)
    other = cache.clone()
    assert torch.equal(plain.forward(q, k, v, other, meta), watched.forward(q, k, v, cache, meta))
    assert cache.equal(other)
    written = int((batch.slot_mapping >= 0).sum()) * HKV * D  # padding rows are not written
    assert batch.num_tokens > batch.num_actual_tokens
    assert counter.counts()["layers.1"] == ClipCount(0, written, 0, written)


def test_counts_add_up_over_write_kv_calls_and_reset() -> None:
    backend, batch, cache, _, k, v = _fp8_layer(1 / 448, 1 / 448)
    impl = backend.impl()
    layer = LayerClipCounter()
    impl.clip_counter = layer
    meta = backend.metadata_builder().build(batch)
    impl.write_kv(k, v, cache, meta=meta)
    once = layer.read()
    impl.write_kv(k, v, cache, batch.slot_mapping)  # positional: the same slots
    twice = layer.read()
    assert twice == ClipCount(*(2 * x for x in once))
    layer.reset()
    assert layer.read() == ClipCount(0, 0, 0, 0)


def test_counting_reads_nothing_on_the_host_during_the_step() -> None:
    backend, batch, cache, q, k, v = _fp8_layer(1 / 448, 1 / 448)
    impl = backend.impl()
    meta = backend.metadata_builder().build(batch)
    impl.forward(q, k, v, cache, meta)  # the first step: the layer reads its new fp8 scales
    counter = ClipCounter()
    counter.watch("layers.0", impl)
    run_layer_guarded(impl, q, k, v, cache, meta)  # raises HostSyncError on a host read
    assert counter.counts()["layers.0"].clipped > 0  # read here, when asked


def test_a_layer_is_watched_once() -> None:
    impl = TorchBackend(SPEC).impl()
    counter = ClipCounter()
    counter.watch("a", impl)
    with pytest.raises(InvalidInputError, match="'a' is already watched"):
        counter.watch("a", impl)


def test_a_layer_is_not_watched_unless_asked() -> None:
    assert TorchBackend(SPEC).impl().clip_counter is None


# --- the values of per-tensor scales ----------------------------------------------------------


def _calls(impl, batch, meta, cache, q, k, v):  # type: ignore[no-untyped-def]
    return {
        "forward": lambda: impl.forward(q, k, v, cache, meta),
        "write_kv(meta=)": lambda: impl.write_kv(k, v, cache, meta=meta),
        "write_kv(slot_mapping)": lambda: impl.write_kv(k, v, cache, batch.slot_mapping),
    }


@pytest.mark.parametrize("call", ["forward", "write_kv(meta=)", "write_kv(slot_mapping)"])
@pytest.mark.parametrize("which", ["key_scale", "value_scale"])
@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), float("-inf")], ids=repr)
def test_a_zero_or_non_finite_fp8_scale_is_refused_before_any_write(
    bad: float, which: str, call: str
) -> None:
    # Regression: such a scale was written with: x / 0 saturates (0 / 0 is NaN) and reads back
    # as 0 * fp8 = 0 or NaN; x / inf reads back as 0 * inf = NaN; all silently.
    backend, batch, cache, q, k, v = _fp8_layer(0.02, 0.02)
    getattr(cache, which).fill_(bad)
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=rf"cache\.{which} = {bad} must be finite and non-"):
        _calls(impl, batch, meta, cache, q, k, v)[call]()
    assert cache.equal(before)


def test_a_scale_changed_in_place_after_a_step_is_checked_again() -> None:
    # vLLM's calc_kv_scales sets _k_scale in place to amax / range: 0 for an all-zero batch
    backend, batch, cache, q, k, v = _fp8_layer(0.02, 0.02)
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    impl.forward(q, k, v, cache, meta)
    assert cache.key_scale is not None
    with torch.inference_mode():  # as during an engine's step: the version counter still moves
        cache.key_scale.zero_()
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=r"cache\.key_scale = 0\.0"):
        impl.forward(q, k, v, cache, meta)
    assert cache.equal(before)
    cache.key_scale.fill_(0.03)  # a good value again: read on the host once more
    with pytest.raises(HostSyncError):
        run_layer_guarded(impl, q, k, v, cache, meta)
    impl.forward(q, k, v, cache, meta)  # served, the value read
    run_layer_guarded(impl, q, k, v, cache, meta)  # and not read again


def test_a_negative_fp8_scale_round_trips_and_is_served() -> None:
    # fp8(x / -s) * -s == fp8(x / s) * s: the formats are sign-symmetric (vLLM's loader turns
    # its -1 "not loaded" sentinel into 1.0, but a negative scale is not wrong)
    outs = []
    for sign in (1, -1):
        backend, batch, cache, q, k, v = _fp8_layer(0.02 * sign, 0.03 * sign)
        impl, meta = backend.impl(), backend.metadata_builder().build(batch)
        impl.forward(q, k, v, cache, meta)
        outs.append(impl.forward(q, None, None, cache, meta))
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])


def test_fp8_scales_made_under_inference_mode_are_served() -> None:
    with torch.inference_mode():
        backend, batch, cache, q, k, v = _fp8_layer(0.02, 0.02)
        assert cache.key_scale is not None and cache.key_scale.is_inference()
        impl, meta = backend.impl(), backend.metadata_builder().build(batch)
        impl.forward(q, k, v, cache, meta)
        bad = cache.key_scale.clone().fill_(float("nan"))
        with pytest.raises(InvalidInputError, match=r"cache\.key_scale = nan"):
            impl.forward(q, k, v, replace(cache, key_scale=bad), meta)


def test_an_impl_serving_two_layers_reads_each_caches_scales_once() -> None:
    # Regression: the impl remembered the last cache's scales only, so an impl called with two
    # layers' caches in turn read a scale on the host at every call (a sync per layer on an
    # accelerator; a capture of such a step failed on the CPU tape)
    backend, batch, cache, q, k, v = _fp8_layer(0.02, 0.02)
    other = backend.allocate_kv_cache(cache.num_blocks)
    assert other.key_scale is not None and other.value_scale is not None
    other.key_scale.fill_(0.03)
    other.value_scale.fill_(0.04)
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    impl.forward(q, k, v, cache, meta)  # each cache's first sight: its scales read
    impl.forward(q, k, v, other, meta)
    for layer_cache in (cache, other, cache, other):
        run_layer_guarded(impl, q, k, v, layer_cache, meta)  # raises HostSyncError on a read


def test_checked_states_forget_all_past_their_bound_and_see_in_place_changes() -> None:
    # The one bounded memory every impl keeps of the scale states it checked (core, MLA,
    # iluvatar's int8 value scale): an in-place change is a new state; past the bound (an
    # engine replacing scales step after step) everything is forgotten and read again
    scale = torch.tensor(0.02)
    states = kit.CheckedStates(bound=2)
    first = kit.tensor_state(scale)
    states.add(first)
    scale.fill_(0.03)
    assert first in states and kit.tensor_state(scale) not in states
    states.add(kit.tensor_state(scale))
    states.add(kit.tensor_state(torch.tensor(0.04)))
    assert len(states) == 1 and first not in states
    with torch.inference_mode():
        frozen = torch.tensor(0.05)
    assert kit.tensor_state(frozen) == (frozen.data_ptr(), None) and kit.tensor_state(None) is None
