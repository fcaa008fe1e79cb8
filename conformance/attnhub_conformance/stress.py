"""Preparing and checking the cases that find kernel bugs in the field: long contexts (needle
keys in a long haystack, the reference in chunks), non-contiguous inputs (views of one fused QKV
projection, a strided output) and extreme logits (scores ~1e4, equal logits, the softcap limit,
very negative ALiBi terms).

Steps are prepared by ``harness.prepare`` (random block table, garbage cache, the cached context
written through the backend's own ``write_kv``); what a case needs on top is written here
through the backend's ``write_kv`` too (needles, shifted keys), so the cache holds what the
reference reads.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from attnhub import Tolerance, reference, testing
from attnhub_conformance import harness
from attnhub_conformance.harness import Layer, Step

#: The score a needle key gets from its request's last query row (averaged over the query
#: heads of its kv head): above the log of a 128k-key haystack's sum (about 12.3 for N(0, 1)
#: scores), so the needles and the haystack both carry weight.
NEEDLE_SCORE = 12.0
#: A needle sits past this many keys where the context is long enough (the precision a kernel
#: may lose past 16k keys shows there).
PAST_16K = 16 * 1024 + 5
#: The shift of every score of the large-score case: ~1e4 (exp of it overflows every float
#: format, so a softmax that does not subtract its running maximum gives inf / NaN).
SCORE_SHIFT = 1.0e4
#: Query gain of the softcap case: scores ~80x the cap, so tanh saturates (logits at +-cap).
SOFTCAP_GAIN = 80.0
#: Where a backend declares ``softcap_score_limit``, the case's largest |score| is this
#: fraction of it (in caps), over every key the cache holds (kernels compute masked slots too).
SOFTCAP_LIMIT_MARGIN = 0.9


def softcap_gain(step: Step, layer: Layer) -> float:
    """The query gain of the softcap case: :data:`SOFTCAP_GAIN`, or less where the backend
    declares ``softcap_score_limit``, so that no score the kernel computes (any query row
    against any key in the cache) exceeds :data:`SOFTCAP_LIMIT_MARGIN` of that many caps: the
    case then proves saturation up to the declared limit, not past it."""
    limit = step.backend.capabilities.softcap_score_limit
    cap = step.spec.logits_soft_cap
    if limit is None or cap is None:
        return SOFTCAP_GAIN
    spec = step.spec
    group = spec.num_heads // spec.num_kv_heads
    plain = layer.cache.unpacked()
    keys = plain.key.to(torch.float64)  # every slot's keys, NHD or HND blocks
    if plain.layout == "HND":
        keys = keys.transpose(1, 2)
    keys = keys.reshape(-1, spec.num_kv_heads, spec.head_size)  # [slots, hkv, d]
    keys = torch.cat([keys, layer.key.to(torch.float64)])  # and the step's new keys
    query = layer.query.to(torch.float64).reshape(-1, spec.num_kv_heads, group, spec.head_size)
    top = 0.0
    for h in range(spec.num_kv_heads):  # [tokens * group, slots] per kv head
        scores = query[:, h].reshape(-1, spec.head_size) @ keys[:, h].T
        top = max(top, float(scores.abs().max()) * spec.scale / cap)
    if top == 0.0:
        return SOFTCAP_GAIN
    return min(SOFTCAP_GAIN, SOFTCAP_LIMIT_MARGIN * limit / top)


# --- long contexts --------------------------------------------------------------------------


def needle_positions(context_len: int, block_size: int) -> list[int]:
    """Context positions that get a needle key: early, past 16k keys, and in the last blocks."""
    pos = [context_len // 7, PAST_16K, context_len - block_size - 2, context_len - 1]
    return sorted({p for p in pos if 0 <= p < context_len})


def plant_needles(step: Step, layer: Layer) -> None:
    """Rewrite a few cached context keys of each request (through the backend's ``write_kv``)
    as needles: a key along the sum of its kv head's query heads of the request's last query
    row, long enough that those heads score it about :data:`NEEDLE_SCORE`."""
    spec, plan = step.spec, step.plan
    assert layer.context_slots is not None and layer.context_key is not None
    assert layer.context_value is not None
    bs, hkv, d = spec.block_size, spec.num_kv_heads, spec.head_size
    group = spec.num_heads // hkv
    qsl = step.batch.query_start_loc_cpu.tolist()
    where = {int(s): i for i, s in enumerate(layer.context_slots.tolist())}
    rows: list[int] = []
    keys: list[torch.Tensor] = []
    for r, (q_len, seq_len) in enumerate(plan.requests):
        positions = needle_positions(seq_len - q_len, bs)
        if not positions:
            continue
        last = layer.query[qsl[r + 1] - 1].to("cpu", torch.float64).view(hkv, group, d)
        direction = last.sum(1)  # [hkv, d]
        unit = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        proj = float((last * unit[:, None]).sum(-1).mean().clamp_min(0.5))
        key = (unit * (NEEDLE_SCORE / (spec.scale * proj))).to(layer.context_key.dtype)
        for p in positions:
            slot = int(step.block_table[r, p // bs]) * bs + p % bs
            rows.append(where[slot])
            keys.append(key)
    if not rows:
        return
    idx = torch.tensor(rows)
    layer.context_key[idx] = torch.stack(keys).to(layer.context_key.device)
    slots = layer.context_slots[idx]
    dev = step.device
    layer.impl.write_kv(
        layer.context_key[idx].to(dev), layer.context_value[idx].to(dev), layer.cache, slots.to(dev)
    )


def chunked_reference(
    step: Step, layer: Layer, *, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:  # [n, H, D] f64, host
    """``harness.reference_output`` through ``reference.paged_attention_chunked``."""
    caps, kv, n = step.backend.capabilities, step.spec.kv_cache_dtype, step.n
    query = testing.quantized_query(layer.query[:n], caps, kv)
    out, _ = reference.paged_attention_chunked(
        query,
        layer.cache,
        step.batch,
        step.spec,
        alibi_slopes=layer.alibi_slopes,
        sinks=layer.sinks,
        compute_dtype=compute_dtype,
    )
    return out


def assert_long_matches(step: Step, layer: Layer, out: torch.Tensor) -> None:
    """``harness.assert_matches_reference`` for a long context: the declared tolerance against
    the float64 reference, the rounding check against a plain computation in the model dtype,
    padding rows zero; both references computed in chunks."""
    n, dtype = step.n, step.spec.dtype
    want = harness.output_shape(step, layer)
    assert out.shape == want and out.dtype == dtype, (
        f"{step.label}: forward returned {list(out.shape)} {out.dtype}, expected "
        f"{list(want)} {dtype}"
    )
    tol = harness.tolerance(step)
    exact = chunked_reference(step, layer)
    said = f"declared tolerance atol={tol.atol:g} rtol={tol.rtol:g}"
    why = testing.mismatch(out[:n], exact, tol, step.batch)
    assert why is None, (
        f"{step.label}: forward differs from attnhub.reference ({dtype}, {said}): {why}"
    )
    rounded = chunked_reference(step, layer, compute_dtype=dtype)
    why = testing.rounding_mismatch(out[:n], exact, rounded, dtype)
    assert why is None, f"{step.label}: forward ({dtype}, {said}): {why}"
    pad = out[n:].detach().to("cpu")
    assert bool((pad == 0).all()), f"{step.label}: padding rows {n}.. must come back as zeros"


# --- non-contiguous inputs ------------------------------------------------------------------


def fused_qkv(layer: Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qkv, q, k, v)``: one ``[T, (H + 2 * Hkv) * D]`` tensor holding the layer's query, key
    and value side by side, and the three as an engine gets them from it (``qkv.split`` along
    the last dimension, viewed as ``[T, heads, D]``: strided rows, dense channels)."""
    q, k, v = layer.query, layer.key, layer.value
    t, h, d = q.shape
    hkv = k.shape[1]
    qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    q_v, k_v, v_v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return qkv, q_v.view(t, h, d), k_v.view(t, hkv, d), v_v.view(t, hkv, d)


def strided_output(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: a NaN-filled ``[T, 2 * H * D + 3]`` buffer and the ``[T, H, D]`` view
    of its columns ``H * D + 3 ...`` (rows strided, not 16-byte aligned): where an engine's
    layer writes into a slice of a larger activation buffer."""
    t, h, d = query.shape
    buffer = query.new_full((t, 2 * h * d + 3), float("nan"))
    view = buffer[:, h * d + 3 : 2 * h * d + 3].view(t, h, d)
    return buffer, view


# --- extreme logits -------------------------------------------------------------------------


def shift_scores(step: Step, layer: Layer, shift: float) -> None:
    """Add ``shift`` to every score: channel 0 of every key (cached context and new) becomes
    ``a``, and channel 0 of every query ``shift / (scale * a)``, so each score gains the same
    ``scale * q0 * a`` (about ``shift``) and the softmax is that of the other channels. The
    context is rewritten through the backend's ``write_kv``."""
    spec = step.spec
    a = 4.0
    with torch.no_grad():
        layer.query[..., 0] = shift / (spec.scale * a)
        if step.plan.new_kv:
            layer.key[..., 0] = a
    if layer.context_slots is None:
        return
    assert layer.context_key is not None and layer.context_value is not None
    layer.context_key[..., 0] = a
    dev = step.device
    layer.impl.write_kv(
        layer.context_key.to(dev),
        layer.context_value.to(dev),
        layer.cache,
        layer.context_slots.to(dev),
    )


def score_rounding_allowance(step: Step, layer: Layer) -> torch.Tensor:  # [n, H, D] f64
    """What rounding the scores in float32 can change in the output, per element, after
    :func:`shift_scores` (call it after forward: over the new keys as written). A kernel
    summing a score's ``D`` products in float32, in any order, gets it to within
    ``delta = D * eps32 * sum_d |q_d k_d|`` (Higham's bound; the shift's product is most of
    that sum). That moves each probability by at most ``2 * delta * p`` (its numerator and its
    normalizer), so the output by at most ``2 * delta * sum_j p_j |v_j|``: the reference over
    ``|V|`` with the probabilities so scaled. ``sum_d |q_d k_d|`` is bounded by
    ``max |q0| * max |k0| + |q_rest| * |k_rest|`` (times the scale)."""
    spec, n = step.spec, step.n
    q = layer.query[:n].to("cpu", torch.float64)
    keys = [
        t for t in (layer.context_key, layer.key if step.plan.new_kv else None) if t is not None
    ]
    k = torch.cat([t.to("cpu", torch.float64).reshape(-1, spec.head_size) for t in keys])
    s_bound = spec.scale * (
        float(q[..., 0].abs().max()) * float(k[:, 0].abs().max())
        + float(q[..., 1:].norm(dim=-1).max()) * float(k[:, 1:].norm(dim=-1).max())
    )
    delta = spec.head_size * torch.finfo(torch.float32).eps * s_bound
    cache = layer.cache
    assert cache.value.is_floating_point() and cache.value_scale is None, (
        f"{step.label}: the large-score case runs over an unquantized cache"
    )
    magnitudes = replace(cache, value=cache.value.abs())
    out, _ = reference.paged_attention(
        layer.query[:n],
        magnitudes,
        step.batch,
        spec,
        alibi_slopes=layer.alibi_slopes,
        sinks=layer.sinks,
        probabilities=lambda p: 2 * delta * p,
    )
    return out


def assert_extreme_matches(
    step: Step, layer: Layer, out: torch.Tensor, allowance: torch.Tensor | None
) -> None:
    """The output is finite, within the declared tolerance (plus ``allowance``, where the
    scores' own rounding is large) of the float64 reference, and no further from it than
    rounding explains; padding rows zero."""
    n, dtype = step.n, step.spec.dtype
    assert bool(torch.isfinite(out[:n]).all()), (
        f"{step.label}: forward returned NaN or inf where the math has none"
    )
    tol: Tolerance = harness.tolerance(step)
    exact = harness.reference_output(step, layer)
    why = testing.mismatch(out[:n], exact, tol, step.batch, allowance=allowance)
    assert why is None, f"{step.label}: forward differs from attnhub.reference ({dtype}): {why}"
    rounded = harness.reference_output(step, layer, compute_dtype=dtype)
    if allowance is None:
        why = testing.rounding_mismatch(out[:n], exact, rounded, dtype)
        assert why is None, f"{step.label}: forward ({dtype}): {why}"
    pad = out[n:].detach().to("cpu")
    assert bool((pad == 0).all()), f"{step.label}: padding rows {n}.. must come back as zeros"
