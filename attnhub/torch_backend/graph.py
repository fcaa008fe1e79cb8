"""The torch backend's graph path: a step whose every shape is fixed by its descriptor.

The ordinary path plans chunks on the host from the step's lengths (how many requests per
attention call, how many keys each gathers): shapes a captured graph would freeze. Captured
steps (uniform batches: every request has ``Q`` query tokens, GraphSupport.UNIFORM_BATCH) take
this path instead, where the shapes depend only on the descriptor (``R`` requests, ``Q``
tokens each, ``W`` blocks per request: the persistent block table's width) and every per-step
value is read on the device from the persistent buffers:

- KV write (``attnhub.kv_write.FixedShapeWrite``): padding rows (slot -1) cannot be left out
  without a data-dependent shape, so each is redirected to the step's first written row (same
  slot, same value: duplicate writes of one value, whatever their order); a step that writes
  nothing rewrites slot 0 with its own bytes.
- attention: each request gathers all ``W`` blocks of its table row (entries past its own
  blocks, which may hold anything, read block 0), keys past ``seq_len`` are zeroed and masked,
  and the visibility (causal, window) and ALiBi distances come from ``seq_lens`` on the device;
  one float32 attention call (``kernels.attend_eager``) for the whole step.
Cost: every request attends over ``W * block_size`` keys, the price of static shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnhub.batch import BatchMetadata
from attnhub.kv_cache import PagedKVCache
from attnhub.kv_write import FixedShapeWrite, read_slots, write_slots
from attnhub.quant import indexable, quantize_fp8
from attnhub.spec import AttentionSpec
from attnhub.torch_backend import kernels
from attnhub.torch_backend.plan import Chunk


@dataclass(frozen=True)
class GraphStep:
    """The fixed shape of a captured step."""

    num_reqs: int  # R
    query_len: int  # Q: every request's
    width: int  # W: blocks per request (the persistent block table's width)

    @classmethod
    def of(cls, batch: BatchMetadata) -> GraphStep:
        return cls(
            num_reqs=batch.num_reqs,
            query_len=batch.num_actual_tokens // max(1, batch.num_reqs),
            width=int(batch.block_table.shape[1]),
        )


def graph_write(
    key: torch.Tensor,  # [>= T, Hkv, D]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = padding (device: the persistent buffer)
    targets: Sequence[Any],  # the impl's _WriteTarget per plane
) -> None:
    write = FixedShapeWrite.of(slot_mapping)
    for src, target in zip((key, value), targets, strict=True):
        x = src.index_select(0, write.rows)
        if target.scale is not None:  # fp8: stored as fp8(x / scale)
            x = quantize_fp8(x, target.scale, target.dtype)
        held = read_slots(target.plane, target.flat, write.slots)
        write_slots(target.plane, target.flat, write.slots, write.pick(indexable(x), held))


def graph_attend(
    spec: AttentionSpec,
    step: GraphStep,
    query: torch.Tensor,  # [T, H, D]
    cache: PagedKVCache,
    batch: BatchMetadata,  # over the persistent buffers
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,  # [T, H, Dv]
    lse: torch.Tensor | None = None,  # [T, H] float32
) -> None:
    R, Q, W = step.num_reqs, step.query_len, step.width
    bs, Hkv = cache.block_size, spec.num_kv_heads
    L = W * bs
    dev = query.device
    seq = batch.seq_lens[:R].long()  # [R]
    cols = torch.arange(W, device=dev)
    in_use = cols[None, :] < ((seq + bs - 1) // bs)[:, None]  # [R, W]
    ids = torch.where(in_use, batch.block_table[:R].long(), 0).reshape(-1)  # [R * W]
    pos_k = torch.arange(L, device=dev)  # [L]
    own = pos_k[None, :] < seq[:, None]  # [R, L]: the request's own keys
    hidden = ~own[:, None, :, None]  # [R, 1, L, 1]

    def gather(plane: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        g = plane.index_select(0, ids)  # [R * W, bs, Hkv, D] (values: Dv)
        g = g.view(R, L, Hkv, plane.shape[3]).permute(0, 2, 1, 3)  # [R, Hkv, L, D]
        if scale is not None:
            g = (g.float() * scale).to(spec.dtype)
        return g.masked_fill(hidden, 0)  # stale keys/values (NaN) never reach the math

    k = gather(cache.key, cache.key_scale)
    v = gather(cache.value, cache.value_scale)
    pos_q = (seq - Q)[:, None] + torch.arange(Q, device=dev)[None, :]  # [R, Q]
    visible = own[:, None, :].expand(R, Q, L)  # [R, Q, L]
    left, right = spec.window
    if spec.causal and batch.causal:
        right = 0
    if right >= 0:
        visible = visible & (pos_k[None, None, :] <= pos_q[:, :, None] + right)
    if left >= 0:
        visible = visible & (pos_k[None, None, :] >= pos_q[:, :, None] - left)
    distance = None
    if spec.use_alibi:
        distance = (pos_q[:, :, None] - pos_k[None, None, :]).abs().float()[:, None, None]
    chunk = Chunk(
        first_token=0,
        num_reqs=R,
        query_len=Q,
        kv_len=L,
        num_blocks=W,
        block_ids=ids,
        pad_tokens=None,
        visible=visible[:, None, None],  # [R, 1, 1, Q, L]
        mask=None,
        causal_square=False,
        distance=distance,
    )
    rows = slice(0, R * Q)
    kernels.attend_eager(
        query[rows],
        k,
        v,
        chunk,
        spec.scale,
        spec.logits_soft_cap,
        alibi_slopes,
        sinks,
        out[rows],
        None if lse is None else lse[rows],
    )
