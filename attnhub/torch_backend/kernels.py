"""The torch backend's per-layer math: gather a chunk's blocks, then one attention call.

Two paths, both checked against ``attnhub.reference`` by the tests:
  - SDPA: ``torch.nn.functional.scaled_dot_product_attention`` with GQA folded into the query
    rows (no K/V head expansion), an explicit visibility mask where needed (SDPA's own
    ``is_causal`` is top-left aligned, so it is used only when query_len == kv_len);
  - eager: scores computed in float32, tiled over query tokens, for what SDPA cannot express
    (softcap, ALiBi, sinks, and each row's LSE where a caller asks for it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnhub.torch_backend.plan import Chunk

EAGER_QUERY_TILE = 256  # query tokens per eager tile: bounds the [rows, L] score matrix


def attend_sdpa(
    q_rows: torch.Tensor,  # [C * Q, H, D]
    k: torch.Tensor,  # [C, Hkv, L, D] (a strided view of the gathered blocks)
    v: torch.Tensor,  # [C, Hkv, L, Dv]
    chunk: Chunk,
    scale: float,
    out_rows: torch.Tensor,  # [C * Q, H, Dv]
) -> None:
    C, Q = chunk.num_reqs, chunk.query_len
    _, Hkv, _, D = k.shape
    Dv = v.shape[3]  # the value head size (head_size_v; D unless the spec says otherwise)
    H = q_rows.shape[1]
    if chunk.causal_square:
        # One request, no cached context: bottom-right == top-left, so is_causal is exact.
        # Contiguous heads-first operands with K/V heads expanded: measured as fast as dense
        # SDPA; strided or enable_gqa operands were 4-10% slower (docs/backends/torch.md).
        q = q_rows.transpose(0, 1).contiguous()[None]  # [1, H, Q, D]
        k_h = k[0].repeat_interleave(H // Hkv, dim=0)[None]  # [1, H, L, D]
        v_h = v[0].repeat_interleave(H // Hkv, dim=0)[None]
        o = F.scaled_dot_product_attention(q, k_h, v_h, is_causal=True, scale=scale)
        out_rows.copy_(o[0].transpose(0, 1))
        return
    group = H // Hkv
    if Q == 1:  # decode: the rows of a kv head are its group's query heads, a plain view
        q = q_rows.view(C, Hkv, group, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)
        # copied through a view of the output (split, never merged): SDPA's CUDA kernels
        # return o laid out [C, group, Hkv, Dv], whose (Hkv, group) cannot merge into H
        out_rows.view(C, Hkv, group, Dv).copy_(o)
        return
    q = q_rows.view(C, Q, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(C, Hkv, group * Q, D)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=chunk.mask, scale=scale
    )  # [C, Hkv, group * Q, Dv]
    out_rows.view(C, Q, Hkv, group, Dv).copy_(o.view(C, Hkv, group, Q, Dv).permute(0, 3, 1, 2, 4))


def as_eager(chunk: Chunk, group: int) -> Chunk:
    """A chunk planned for SDPA as the eager pass reads it, for a call that asks for the LSE
    (which SDPA does not return): its SDPA mask (bool, or additive 0 / -inf) as the eager
    visibility ``[C, 1, group or 1, Q, L]``, its causal square as the causal pattern."""
    C, Q, L = chunk.num_reqs, chunk.query_len, chunk.kv_len
    visible = None
    if chunk.causal_square:  # Q == L: the lower triangle
        visible = torch.ones(Q, L, dtype=torch.bool, device=chunk.block_ids.device).tril()
        visible = visible.view(1, 1, 1, Q, L)
    elif chunk.mask is not None:
        seen = chunk.mask if chunk.mask.dtype == torch.bool else chunk.mask == 0
        visible = seen.view(C, 1, 1, 1, L) if Q == 1 else seen.view(C, 1, group, Q, L)
    return chunk._replace(visible=visible, mask=None, causal_square=False)


def attend_eager(
    q_rows: torch.Tensor,  # [C * Q, H, D]
    k: torch.Tensor,  # [C, Hkv, L, D]
    v: torch.Tensor,  # [C, Hkv, L, Dv]
    chunk: Chunk,
    scale: float,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,  # [H] float32
    sinks: torch.Tensor | None,  # [H] float32
    out_rows: torch.Tensor,  # [C * Q, H, Dv]
    lse_rows: torch.Tensor | None = None,  # [C * Q, H] float32: each row's natural-log LSE
) -> None:
    """Attention in float32 from the scores up; with ``lse_rows``, also each row's log-sum-exp
    ``m + log(denominator)`` of the same pass (a sink's term included; +inf where a row sees no
    key and no sink)."""
    C, Q = chunk.num_reqs, chunk.query_len
    Hkv, D = k.shape[1], k.shape[3]
    group = q_rows.shape[1] // Hkv
    q = q_rows.view(C, Q, Hkv, group, D).permute(0, 2, 3, 1, 4).float()  # [C, Hkv, g, Q, D]
    kf = k.float()[:, :, None]  # [C, Hkv, 1, L, D]
    vf = v.float()[:, :, None]
    out = out_rows.view(C, Q, Hkv, group, v.shape[3])
    lse = None if lse_rows is None else lse_rows.view(C, Q, Hkv, group)
    slopes = None if alibi_slopes is None else alibi_slopes.view(1, Hkv, group, 1, 1)
    sink = None if sinks is None else sinks.view(1, Hkv, group, 1, 1)
    for t0 in range(0, Q, EAGER_QUERY_TILE):
        t1 = min(Q, t0 + EAGER_QUERY_TILE)
        s = (q[:, :, :, t0:t1] @ kf.transpose(-1, -2)) * scale  # [C, Hkv, g, t, L]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if slopes is not None:
            assert chunk.distance is not None
            s = s - slopes * chunk.distance[:, :, :, t0:t1]
        if chunk.visible is not None:
            s = s.masked_fill(~chunk.visible[:, :, :, t0:t1], -math.inf)
        m = s.amax(dim=-1, keepdim=True)
        if sink is not None:
            m = torch.maximum(m, sink)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - m)
        o = (p @ vf) / denom  # [C, Hkv, g, t, Dv]
        out[:, t0:t1].copy_(o.permute(0, 3, 1, 2, 4))
        if lse is not None:
            # no key and no sink: m = -inf, an empty row (+inf, as attnhub.reference)
            row = (m + torch.log(denom)).masked_fill(torch.isneginf(m), math.inf)[..., 0]
            lse[:, t0:t1].copy_(row.permute(0, 3, 1, 2))
