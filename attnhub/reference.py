"""The golden math: attention per request, in float64, from first principles. Slow on purpose.

This is the one place attnhub's conventions are written plainly; every backend is checked against
it, and it reproduces every case of ``shared/golden/attention_conventions.json``.

Conventions, in the order they are applied to the scores of one request:
  1. scores   s[h, i, j] = scale * q[i, h] . k[j, h // (num_heads / num_kv_heads)]  (GQA)
  2. softcap  s = cap * tanh(s / cap)                       (after scaling, before bias/mask)
  3. ALiBi    s += -slope[h] * |pos(i) - j|                 (= slope * (j - pos(i)) when causal)
  4. mask     query i sits at position pos(i) = context_len + i ("bottom-right" alignment) and
              sees key j iff pos(i) - left <= j <= pos(i) + right, where (left, right) is the
              window (-1 = unbounded) and causal forces right = 0
  5. sinks    one logit per query head joins the softmax denominator (not scaled, no value)
  6. out      softmax(s) @ v;  LSE = log(sum_j exp(s_j) [+ exp(sink)]), natural log
A row that sees no key (and has no sink) gives output 0 and LSE +inf (flash-attn's convention).

MLA (``attnhub.mla``): the absorbed and the expanded form over a latent cache, the same math
through :func:`attention`, with the one scale both forms share (see the section at the end).

``compute_dtype`` (default float64) runs the same math as a plain implementation in that dtype
would: operands, scores, probabilities and output rounded to it (softmax itself as torch does
it). The conformance suite uses it to learn how far rounding alone takes a bf16 / fp16 / fp32
result from the float64 one, as flash-attn's tests do.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import PagedKVCache
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.quant import (
    dequantize_fp8,
    dequantize_int8,
    int8_scale,
    quantize_fp8,
    quantize_int8,
    quantize_int8_dynamic,
)
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec

__all__ = [
    "absorb_query",
    "attention",
    "dequantize_fp8",
    "dequantize_int8",
    "expand_latent",
    "int8_scale",
    "merge_attn_states",
    "mla_absorbed",
    "mla_expanded",
    "mla_output",
    "paged_attention",
    "paged_attention_chunked",
    "paged_mla_absorbed",
    "paged_mla_expanded",
    "quantize_fp8",
    "quantize_int8",
    "quantize_int8_dynamic",
    "read_latent_sequence",
    "read_sequence",
    "write_kv",
    "write_latent_kv",
]

F64 = torch.float64


def attention(
    query: torch.Tensor,  # [query_len, num_heads, head_size]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_size]: the whole sequence
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_size_v]
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    logits_soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [num_heads]
    sinks: torch.Tensor | None = None,  # [num_heads]
    compute_dtype: torch.dtype = F64,
    probabilities: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [query_len, num_heads, head_size_v], lse [H, q_len]
    """Attention of one request whose last ``query_len`` positions are the new tokens. Returns
    float64 (computed in ``compute_dtype``).

    ``probabilities``, where given, maps the normalized probabilities ``p`` [H, q_len, seq_len]
    (masked keys 0) to what multiplies ``V`` instead: e.g. ``attnhub.quant.round_probabilities``
    for a kernel that rounds them. The LSE is not affected."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    assert q_len <= seq_len, "the query tokens are the last positions of the sequence"
    group = num_heads // num_kv_heads
    dt = compute_dtype
    q = query.to(dt)
    # GQA: query head h reads kv head h // group.
    k = key.to(dt).repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size]
    v = value.to(dt).repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_size_v]

    s = torch.einsum("ihd,jhd->hij", q, k) * scale  # [num_heads, q_len, seq_len]
    if logits_soft_cap:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)

    # Bottom-right alignment: new token i is at position context_len + i.
    pos_q = torch.arange(q_len, dtype=F64)[:, None] + (seq_len - q_len)  # [q_len, 1]
    pos_k = torch.arange(seq_len, dtype=F64)[None, :]  # [1, seq_len]
    if alibi_slopes is not None:
        s = s - (alibi_slopes.to(F64)[:, None, None] * (pos_q - pos_k).abs()).to(dt)

    left, right = window
    if causal:
        right = 0
    visible = torch.ones(q_len, seq_len, dtype=torch.bool)
    if left >= 0:
        visible &= pos_k >= pos_q - left
    if right >= 0:
        visible &= pos_k <= pos_q + right
    s = s.masked_fill(~visible, -math.inf)

    # Sinks: an extra logit per head in the denominator, carrying no value.
    if sinks is not None:
        sink = sinks.to(dt)[:, None, None].expand(num_heads, q_len, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)  # [num_heads, q_len]
    else:
        lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)  # rows that see nothing: output 0, LSE +inf
    p = torch.exp(s - lse.masked_fill(empty, 0)[..., None]).masked_fill(~visible, 0)
    if probabilities is not None:
        p = probabilities(p)
    out = torch.einsum("hij,jhd->ihd", p, v)  # the value head size: head_size_v
    return out.to(F64), lse.to(F64).masked_fill(empty, math.inf)


def merge_attn_states(
    a_out: torch.Tensor,  # [num_tokens, num_heads, head_size_v]
    a_lse: torch.Tensor,  # [num_heads, num_tokens], natural log, +inf = empty
    b_out: torch.Tensor,
    b_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union."""
    a_lse, b_lse = a_lse.to(F64), b_lse.to(F64)
    # +inf marks an empty part: it contributes weight 0.
    la = a_lse.masked_fill(torch.isposinf(a_lse), -math.inf)
    lb = b_lse.masked_fill(torch.isposinf(b_lse), -math.inf)
    m = torch.maximum(la, lb)
    both_empty = torch.isneginf(m)
    m = m.masked_fill(both_empty, 0)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    total = wa + wb
    denom = total.masked_fill(both_empty, 1)
    out = (wa.T[..., None] * a_out.to(F64) + wb.T[..., None] * b_out.to(F64)) / denom.T[..., None]
    lse = (m + torch.log(denom)).masked_fill(both_empty, math.inf)
    return out, lse


def read_sequence(
    cache: PagedKVCache, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:  # key [S, Hkv, head_size], value [S, Hkv, head_size_v]
    """The keys and values of positions 0..seq_len-1 as the cache holds them, dequantized."""
    cache = cache.unpacked()
    bs = cache.block_size
    pos = torch.arange(seq_len)
    blocks = block_table_row.to("cpu").long()[pos // bs]
    offsets = pos % bs
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    planes = []
    for which, data in (("key", cache.key_nhd()), ("value", cache.value_nhd())):
        raw = data.to("cpu")[blocks, offsets]  # [seq_len, num_kv_heads, the plane's size]
        kind = getattr(fmt, f"{which}_scale")
        scale = getattr(cache, f"{which}_scale")
        if kind == "none":
            planes.append(raw.to(F64))
            continue
        assert scale is not None
        scale = scale.to("cpu", F64)
        if kind == "slot":
            per_slot = cache.slot_scale_nhd(f"{which}_scale")
            assert per_slot is not None
            scale = per_slot.to("cpu", F64)[blocks, offsets][..., None]  # [seq_len, Hkv, 1]
        planes.append(raw.to(F64) * scale)
    return planes[0], planes[1]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    cache: PagedKVCache,
    batch: BatchMetadata,
    spec: AttentionSpec,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = F64,
    probabilities: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_actual_tokens, H, Dv] f64, lse [H, tokens]
    """What a backend's forward must return for ``batch``, reading keys from ``cache``
    (``compute_dtype``: see the module docstring; ``probabilities``: see :func:`attention`)."""
    _check_inputs(query, cache, batch, spec)
    cache = cache.unpacked()  # packed blocks: read once, not per request
    qsl = batch.query_start_loc_cpu.tolist()
    outs, lses = [], []
    for r in range(batch.num_reqs):  # one request at a time, nothing shared between them
        seq_len = int(batch.seq_lens_cpu[r])
        k, v = read_sequence(cache, batch.block_table[r], seq_len)
        out, lse = attention(
            query[qsl[r] : qsl[r + 1]].to("cpu"),
            k,
            v,
            scale=spec.scale,
            causal=spec.causal and batch.causal,
            window=spec.window,
            logits_soft_cap=spec.logits_soft_cap,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.to("cpu"),
            sinks=None if sinks is None else sinks.to("cpu"),
            compute_dtype=compute_dtype,
            probabilities=probabilities,
        )
        outs.append(out)
        lses.append(lse)
    h, d = spec.num_heads, spec.head_size_v
    if not outs:
        return torch.zeros(0, h, d, dtype=F64), torch.zeros(h, 0, dtype=F64)
    return torch.cat(outs), torch.cat(lses, dim=1)


#: Scores (float64 elements) one :func:`paged_attention_chunked` call computes at a time.
CHUNK_SCORES = 1 << 22


def paged_attention_chunked(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    cache: PagedKVCache,
    batch: BatchMetadata,
    spec: AttentionSpec,
    *,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = F64,
    probabilities: Callable[[torch.Tensor], torch.Tensor] | None = None,
    max_scores: int = CHUNK_SCORES,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_actual_tokens, H, Dv] f64, lse [H, tokens]
    """:func:`paged_attention` with bounded memory, for long contexts (tens of thousands of
    keys and more): the same :func:`attention` per request, one query head at a time (heads are
    independent: head ``h`` reads kv head ``h // group``, so no K/V is expanded to every head),
    and, where the step is causal, the query rows in chunks of about ``max_scores / seq_len``:
    rows ``i0..i1-1`` of a request see at most its first ``seq_len - query_len + i1`` keys, and
    are exactly the last rows of that prefix, so :func:`attention` over the prefix gives them
    unchanged. A non-causal step's rows are not chunked (each sees every key)."""
    _check_inputs(query, cache, batch, spec)
    cache = cache.unpacked()
    qsl = batch.query_start_loc_cpu.tolist()
    h_all, d = spec.num_heads, spec.head_size_v
    group = spec.num_heads // spec.num_kv_heads
    causal = spec.causal and batch.causal
    slopes = None if alibi_slopes is None else alibi_slopes.to("cpu")
    sink_all = None if sinks is None else sinks.to("cpu")
    outs, lses = [], []
    for r in range(batch.num_reqs):
        seq_len = int(batch.seq_lens_cpu[r])
        q_req = query[qsl[r] : qsl[r + 1]].to("cpu")
        q_len = q_req.shape[0]
        k, v = read_sequence(cache, batch.block_table[r], seq_len)
        out = torch.zeros(q_len, h_all, d, dtype=F64)
        lse = torch.zeros(h_all, q_len, dtype=F64)
        rows = max(1, max_scores // max(seq_len, 1)) if causal else max(q_len, 1)
        for h in range(h_all):
            kv = h // group
            k_h, v_h = k[:, kv : kv + 1], v[:, kv : kv + 1]
            for i0 in range(0, q_len, rows):
                i1 = min(q_len, i0 + rows)
                end = seq_len - q_len + i1 if causal else seq_len
                o, s = attention(
                    q_req[i0:i1, h : h + 1],
                    k_h[:end],
                    v_h[:end],
                    scale=spec.scale,
                    causal=causal,
                    window=spec.window,
                    logits_soft_cap=spec.logits_soft_cap,
                    alibi_slopes=None if slopes is None else slopes[h : h + 1],
                    sinks=None if sink_all is None else sink_all[h : h + 1],
                    compute_dtype=compute_dtype,
                    probabilities=probabilities,
                )
                out[i0:i1, h : h + 1] = o
                lse[h : h + 1, i0:i1] = s
        outs.append(out)
        lses.append(lse)
    if not outs:
        return torch.zeros(0, h_all, d, dtype=F64), torch.zeros(h_all, 0, dtype=F64)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_inputs(
    query: torch.Tensor, cache: PagedKVCache, batch: BatchMetadata, spec: AttentionSpec
) -> None:
    """The oracle refuses inputs that do not describe one call (InvalidInputError)."""
    want = (spec.num_heads, spec.head_size)
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or tuple(query.shape[1:]) != want:
        got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise InvalidInputError(f"query must be [num_tokens, {want[0]}, {want[1]}], got {got}")
    if query.shape[0] < batch.num_actual_tokens:
        raise InvalidInputError(
            f"query has {query.shape[0]} tokens, the batch has {batch.num_actual_tokens}"
        )
    geometry = (cache.block_size, cache.num_kv_heads, cache.head_size, cache.head_size_v)
    mine = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v)
    if geometry != mine or batch.block_size != spec.block_size:
        raise InvalidInputError(
            f"cache (block_size, kv heads, head_size, head_size_v) = {geometry} and batch "
            f"block_size {batch.block_size} do not match the spec's {mine}"
        )


def write_kv(
    cache: PagedKVCache,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size_v]
    slot_mapping: torch.Tensor,  # [n <= num_tokens]; -1 = padding
) -> None:
    """Write token by token what a cache must hold after a KV write (padding skipped)."""
    with cache.edit() as plain:  # a packed cache: its logical planes, packed back after
        _write_kv(plain, key, value, slot_mapping)


def _write_kv(
    cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    fmt = KV_CACHE_DTYPES[cache.kv_cache_dtype]
    key_nhd, value_nhd = cache.key_nhd(), cache.value_nhd()
    bs = cache.block_size
    for t, slot in enumerate(slot_mapping.to("cpu").tolist()):
        if slot < 0:  # padding token: never written
            continue
        b, o = divmod(slot, bs)
        for which, src, dst in (("key", key[t], key_nhd), ("value", value[t], value_nhd)):
            kind = getattr(fmt, f"{which}_scale")
            scale = getattr(cache, f"{which}_scale")
            if kind == "none":
                dst[b, o] = src.to(dst.dtype)
            elif kind == "tensor":
                dst[b, o] = quantize_fp8(src, scale, dst.dtype)
            elif kind == "channel":
                dst[b, o] = quantize_int8(src, scale)
            elif kind == "slot":
                q, s = quantize_int8_dynamic(src, dim=-1)  # per kv head, over head_size
                dst[b, o] = q
                plane = cache.slot_scale_nhd(f"{which}_scale")
                assert plane is not None
                plane[b, o] = s[:, 0]


# --- MLA (multi-head latent attention; attnhub.mla) -------------------------------------------
#
# Per token the cache holds a latent kv_c [kv_lora_rank] and a rotary key part k_pe [rope],
# shared by every head. Weights as vLLM splits kv_b_proj: W_UK [kv_lora_rank, H, qk_nope],
# W_UV [kv_lora_rank, H, v_head_dim]. The two forms below compute the same attention:
#   expanded: keys [kv_c @ W_UK ; k_pe] and values kv_c @ W_UV per head (key head size
#             qk_nope + rope, value head size v_head_dim);
#   absorbed: queries [q_nope @ W_UK^T ; q_pe] (kv_lora_rank + rope), multi-query attention over
#             keys [kv_c ; k_pe] and values kv_c; the latent output times W_UV is the expanded
#             form's output, and the LSEs are equal.
# Scale: both use the expanded form's (qk_nope + rope) ** -0.5 (spec.scale): the absorbed score
# (q_nope W_UK^T) . kv_c + q_pe . k_pe is the same number as q_nope . (kv_c W_UK) + q_pe . k_pe,
# so the absorbed form must not take (kv_lora_rank + rope) ** -0.5 from its wider head.


def absorb_query(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
    w_uk: torch.Tensor,  # [kv_lora_rank, num_heads, qk_nope_head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank] float64
    """The no-rope query moved into latent space: ``ql_nope[t, h] = W_UK[:, h] @ q_nope[t, h]``."""
    return torch.einsum("thp,lhp->thl", q_nope.to(F64), w_uk.to(F64))


def mla_output(
    out_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank]
    w_uv: torch.Tensor,  # [kv_lora_rank, num_heads, v_head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim] float64
    """The absorbed form's latent output per head, projected by ``W_UV``."""
    return torch.einsum("thl,lhv->thv", out_latent.to(F64), w_uv.to(F64))


def expand_latent(
    kv_c: torch.Tensor,  # [seq_len, kv_lora_rank]
    k_pe: torch.Tensor,  # [seq_len, qk_rope_head_dim]
    w_uk: torch.Tensor,  # [kv_lora_rank, num_heads, qk_nope_head_dim]
    w_uv: torch.Tensor,  # [kv_lora_rank, num_heads, v_head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # key [S, H, qk_nope + rope], value [S, H, v] f64
    """Per-head keys ``[kv_c @ W_UK ; k_pe]`` (the rope part shared by every head) and values
    ``kv_c @ W_UV``."""
    kv_c, k_pe = kv_c.to(F64), k_pe.to(F64)
    k_nope = torch.einsum("sl,lhp->shp", kv_c, w_uk.to(F64))
    value = torch.einsum("sl,lhv->shv", kv_c, w_uv.to(F64))
    rope = k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)
    return torch.cat([k_nope, rope], dim=-1), value


def mla_absorbed(
    query: torch.Tensor,  # [query_len, num_heads, kv_lora_rank + rope]: [ql_nope ; q_pe]
    kv_c: torch.Tensor,  # [seq_len, kv_lora_rank]: the whole sequence
    k_pe: torch.Tensor,  # [seq_len, qk_rope_head_dim]
    *,
    scale: float,
    causal: bool = True,
    compute_dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [q_len, H, kv_lora_rank], lse [H, q_len]
    """The absorbed form of one request: every head attends over the one latent "kv head"
    (keys ``[kv_c ; k_pe]``, values ``kv_c``); output in latent space (:func:`mla_output`
    projects it). ``scale``: the expanded form's (see above)."""
    key = torch.cat([kv_c.to(F64), k_pe.to(F64)], dim=-1)[:, None, :]  # [S, 1, L + R]
    value = kv_c.to(F64)[:, None, :]  # [S, 1, L]
    return attention(query, key, value, scale=scale, causal=causal, compute_dtype=compute_dtype)


def mla_expanded(
    query: torch.Tensor,  # [query_len, num_heads, qk_nope + rope]: [q_nope ; q_pe]
    kv_c: torch.Tensor,  # [seq_len, kv_lora_rank]: the whole sequence
    k_pe: torch.Tensor,  # [seq_len, qk_rope_head_dim]
    w_uk: torch.Tensor,  # [kv_lora_rank, num_heads, qk_nope_head_dim]
    w_uv: torch.Tensor,  # [kv_lora_rank, num_heads, v_head_dim]
    *,
    scale: float,
    causal: bool = True,
    compute_dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [q_len, H, v_head_dim], lse [H, q_len]
    """The expanded form of one request: ordinary multi-head attention over the keys and
    values :func:`expand_latent` makes (value head size != key head size)."""
    key, value = expand_latent(kv_c, k_pe, w_uk, w_uv)
    return attention(query, key, value, scale=scale, causal=causal, compute_dtype=compute_dtype)


def read_latent_sequence(
    cache: LatentKVCache, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:  # kv_c [seq_len, kv_lora_rank], k_pe [seq_len, R] f64
    """The latents of positions 0..seq_len-1 as the cache holds them, dequantized."""
    bs = cache.block_size
    pos = torch.arange(seq_len)
    blocks = block_table_row.to("cpu").long()[pos // bs]
    offsets = pos % bs
    parts = []
    for plane in (cache.kv_c, cache.k_pe):
        raw = plane.to("cpu")[blocks, offsets].to(F64)  # [seq_len, width]
        if cache.scale is not None:  # fp8: one per-tensor scale
            raw = raw * cache.scale.to("cpu", F64)
        parts.append(raw)
    return parts[0], parts[1]


def paged_mla_absorbed(
    query: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank + rope]
    cache: LatentKVCache,
    batch: BatchMetadata,
    spec: MLASpec,
    *,
    compute_dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_actual_tokens, H, kv_lora_rank] f64, lse
    """What an absorbed-form (decode) MLA kernel must return for ``batch``: the latent
    output per head, reading the latents from ``cache``."""
    _check_mla_inputs(
        query, spec.latent_size, "kv_lora_rank + qk_rope_head_dim", cache, batch, spec
    )
    return _per_request(
        query,
        cache,
        batch,
        spec.num_heads,
        spec.kv_lora_rank,
        lambda q, kv_c, k_pe: mla_absorbed(
            q, kv_c, k_pe, scale=spec.scale, causal=batch.causal, compute_dtype=compute_dtype
        ),
    )


def paged_mla_expanded(
    query: torch.Tensor,  # [num_tokens, num_heads, qk_nope + rope]
    cache: LatentKVCache,
    batch: BatchMetadata,
    spec: MLASpec,
    w_uk: torch.Tensor,  # [kv_lora_rank, num_heads, qk_nope_head_dim]
    w_uv: torch.Tensor,  # [kv_lora_rank, num_heads, v_head_dim]
    *,
    compute_dtype: torch.dtype = F64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_actual_tokens, H, v_head_dim] f64, lse
    """What the expanded form (prefill) must return for ``batch``, every cached latent
    expanded by ``W_UK`` / ``W_UV``."""
    _check_mla_inputs(
        query, spec.qk_head_dim, "qk_nope_head_dim + qk_rope_head_dim", cache, batch, spec
    )
    h = spec.num_heads
    for name, w, width in (("w_uk", w_uk, spec.qk_nope_head_dim), ("w_uv", w_uv, spec.v_head_dim)):
        want = (spec.kv_lora_rank, h, width)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != want:
            got = list(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise InvalidInputError(f"{name} must be {list(want)}, got {got}")
    w_uk, w_uv = w_uk.to("cpu"), w_uv.to("cpu")
    return _per_request(
        query,
        cache,
        batch,
        h,
        spec.v_head_dim,
        lambda q, kv_c, k_pe: mla_expanded(
            q,
            kv_c,
            k_pe,
            w_uk,
            w_uv,
            scale=spec.scale,
            causal=batch.causal,
            compute_dtype=compute_dtype,
        ),
    )


def _per_request(
    query: torch.Tensor,
    cache: LatentKVCache,
    batch: BatchMetadata,
    num_heads: int,
    out_size: int,
    one: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    qsl = batch.query_start_loc_cpu.tolist()
    outs, lses = [], []
    for r in range(batch.num_reqs):  # one request at a time, nothing shared between them
        kv_c, k_pe = read_latent_sequence(cache, batch.block_table[r], int(batch.seq_lens_cpu[r]))
        out, lse = one(query[qsl[r] : qsl[r + 1]].to("cpu"), kv_c, k_pe)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return torch.zeros(0, num_heads, out_size, dtype=F64), torch.zeros(num_heads, 0, dtype=F64)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _check_mla_inputs(
    query: torch.Tensor,
    head_size: int,
    head_size_is: str,
    cache: LatentKVCache,
    batch: BatchMetadata,
    spec: MLASpec,
) -> None:
    """The oracle refuses inputs that do not describe one MLA call (InvalidInputError)."""
    want = (spec.num_heads, head_size)
    if not isinstance(query, torch.Tensor) or query.dim() != 3 or tuple(query.shape[1:]) != want:
        got = list(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
        raise InvalidInputError(
            f"query must be [num_tokens, {want[0]}, {want[1]}] ({head_size_is}), got {got}"
        )
    if query.shape[0] < batch.num_actual_tokens:
        raise InvalidInputError(
            f"query has {query.shape[0]} tokens, the batch has {batch.num_actual_tokens}"
        )
    geometry = (cache.block_size, cache.kv_lora_rank, cache.qk_rope_head_dim)
    mine = (spec.block_size, spec.kv_lora_rank, spec.qk_rope_head_dim)
    if geometry != mine or batch.block_size != spec.block_size:
        raise InvalidInputError(
            f"cache (block_size, kv_lora_rank, qk_rope_head_dim) = {geometry} and batch "
            f"block_size {batch.block_size} do not match the spec's {mine}"
        )


def write_latent_kv(
    cache: LatentKVCache,
    kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank]
    k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim]
    slot_mapping: torch.Tensor,  # [n <= num_tokens]; -1 = padding
) -> None:
    """Write token by token what a latent cache must hold after a KV write (padding skipped;
    fp8: ``fp8(x / scale)`` with the cache's one scale for both parts)."""
    bs = cache.block_size
    for t, slot in enumerate(slot_mapping.to("cpu").tolist()):
        if slot < 0:  # padding token: never written
            continue
        b, o = divmod(slot, bs)
        for src, dst in ((kv_c[t], cache.kv_c), (k_pe[t], cache.k_pe)):
            if cache.scale is None:
                dst[b, o] = src.to(dst.dtype)
            else:
                dst[b, o] = quantize_fp8(src, cache.scale, dst.dtype)
