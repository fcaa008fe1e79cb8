"""vLLM -> attnhub translations that need no vLLM import (unit-testable anywhere).

- :func:`batch_from_common`: vLLM's ``CommonAttentionMetadata`` (duck-typed) -> ``BatchMetadata``,
  once per step, with tensor slicing only (no per-request Python loop).
- :func:`spec_from_vllm`: a vLLM attention layer's arguments -> ``AttentionSpec``, or the list of
  reasons the adapter itself refuses (features it does not map).
- :func:`cache_views`: vLLM's per-layer KV tensor (logical ``[B, H, N, 2*D]``, K then V in the
  last dim) -> ``PagedKVCache`` views in the backend's layout, without copying.
- :func:`cache_planes`: the same memory as two contiguous K and V planes, for backends whose
  kernels refuse strided planes.
"""

from __future__ import annotations

from typing import Any

import torch

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache
from attnhub.spec import AttentionType

#: vLLM ``cache_dtype`` -> attnhub ``kv_cache_dtype``. Quantized vLLM caches carry per-layer
#: scales (``layer._k_scale``) that the adapter does not map yet: refused (see ``spec_from_vllm``).
KV_CACHE_DTYPES = {"auto": "auto", "bfloat16": "auto", "float16": "auto"}

#: vLLM attention types the adapter maps (encoder-decoder cross attention is not mapped:
#: its keys come from the encoder, not from this step's tokens).
ATTN_TYPES = {
    "decoder": AttentionType.DECODER,
    "encoder_only": AttentionType.ENCODER_ONLY,
}


def spec_from_vllm(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    scale: float,
    kv_cache_dtype: str = "auto",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    attn_type: str = "decoder",
    use_alibi: bool = False,
    use_sinks: bool = False,
    head_size_v: int | None = None,
) -> tuple[AttentionSpec | None, list[str]]:
    """The attnhub spec of one vLLM attention layer, or None and the adapter's reasons."""
    reasons = []
    attn_type = str(getattr(attn_type, "value", attn_type))
    if attn_type not in ATTN_TYPES:
        reasons.append(
            f"vLLM attention type {attn_type!r} is not mapped by attnhub-vllm "
            f"(mapped: {', '.join(ATTN_TYPES)})"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        reasons.append(
            f"vLLM kv_cache_dtype {kv_cache_dtype!r} is not mapped by attnhub-vllm "
            "(quantized caches need vLLM's per-layer k/v scales mapped to attnhub's scale "
            "planes; use kv_cache_dtype='auto')"
        )
    if head_size_v is not None and head_size_v != head_size:
        reasons.append(f"head_size_v {head_size_v} != head_size {head_size} is not supported")
    if logits_soft_cap == 0:  # vLLM's "no softcap"
        logits_soft_cap = None
    if sliding_window is not None and sliding_window < 0:
        sliding_window = None
    if reasons:
        return None, reasons
    try:
        spec = AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
            scale=scale,
            attn_type=ATTN_TYPES[attn_type],
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            use_alibi=use_alibi,
            use_sinks=use_sinks,
        )
    except Exception as exc:  # the spec validates itself; surface its message
        return None, [f"invalid attention spec: {exc}"]
    return spec, []


def batch_from_common(cm: Any, block_size: int) -> BatchMetadata:
    """One step's ``BatchMetadata`` from vLLM's ``CommonAttentionMetadata``.

    Slices only: vLLM's persistent buffers may be longer than the batch. Host copies come from
    ``query_start_loc_cpu`` and, for the sequence lengths, from ``seq_lens`` itself when it
    lives on the host (the CPU platform), else ``seq_lens_cpu_upper_bound`` (exact outside
    async speculative decoding), else one device-to-host copy per step (never per layer).
    """
    n = int(cm.num_reqs)
    qsl_cpu = cm.query_start_loc_cpu[: n + 1]
    seq = cm.seq_lens[:n]
    if seq.device.type == "cpu":
        seq_cpu = seq
    elif getattr(cm, "seq_lens_cpu_upper_bound", None) is not None:
        seq_cpu = cm.seq_lens_cpu_upper_bound[:n]
    else:
        seq_cpu = seq.to("cpu")
    if qsl_cpu.dtype != torch.int32:
        qsl_cpu = qsl_cpu.to(torch.int32)
    if seq_cpu.dtype != torch.int32:
        seq_cpu = seq_cpu.to(torch.int32)
    causal = cm.causal
    if isinstance(causal, torch.Tensor):
        raise NotImplementedError(
            "attnhub-vllm: per-request (tensor) causal flags are not mapped to attnhub"
        )
    if n:  # numpy on the host copies: ~1 us per reduction where a torch op costs ~3-5 us
        qsl_np = qsl_cpu.numpy()
        num_actual = int(qsl_np[n])
        max_q = int((qsl_np[1:] - qsl_np[:-1]).max())
        max_s = int(seq_cpu.numpy().max())
    else:
        num_actual = max_q = max_s = 0
    return BatchMetadata(
        query_start_loc=cm.query_start_loc[: n + 1],
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq,
        seq_lens_cpu=seq_cpu,
        num_reqs=n,
        num_actual_tokens=int(num_actual),
        max_query_len=int(max_q),
        max_seq_len=int(max_s),
        block_table=cm.block_table_tensor[:n],
        slot_mapping=cm.slot_mapping,
        block_size=block_size,
        causal=bool(causal),
    )


def cache_views(kv_cache: torch.Tensor, spec: AttentionSpec, layout: str) -> PagedKVCache:
    """attnhub views of vLLM's per-layer cache ``[num_blocks, num_kv_heads, block_size, 2*D]``
    (logical axes; the physical order is whatever layout vLLM allocated): keys are
    ``[..., :D]``, values ``[..., D:]``. No copy; the views are strided (K and V interleave
    per slot)."""
    d = spec.head_size
    # NHD: [B, N, H, 2D]; HND: vLLM's logical order [B, H, N, 2D] as it is
    t = kv_cache.permute(0, 2, 1, 3) if layout == "NHD" else kv_cache
    return PagedKVCache(
        key=t[..., :d],
        value=t[..., d:],
        block_size=spec.block_size,
        layout=layout,
        kv_cache_dtype=spec.kv_cache_dtype,
    )


def cache_planes(kv_cache: torch.Tensor, spec: AttentionSpec, layout: str) -> PagedKVCache | None:
    """Contiguous K and V planes carved from the memory of vLLM's per-layer cache: the first
    half of its elements hold every block's keys, the second half every block's values
    (``[num_blocks, block_size, H, D]`` each for NHD, ``[num_blocks, H, block_size, D]`` for
    HND). For backends whose kernels need contiguous planes; no extra memory. The bytes of
    page ``b`` then no longer hold block ``b`` alone, so anything in vLLM that moves pages by
    block id (KV-transfer connectors, offloading) must not run beside it. None when the
    tensor's memory is not one dense run (vLLM's logical view of it is permuted: any order of
    its axes in memory will do)."""
    order = sorted(range(kv_cache.dim()), key=lambda i: -kv_cache.stride(i))
    dense = kv_cache.permute(order)  # the axes in memory order
    if not dense.is_contiguous():
        return None
    num_blocks = kv_cache.shape[0]
    h, n, d = spec.num_kv_heads, spec.block_size, spec.head_size
    flat = dense.view(-1)
    half = num_blocks * n * h * d
    if flat.numel() != 2 * half:
        return None
    shape = (num_blocks, n, h, d) if layout == "NHD" else (num_blocks, h, n, d)
    return PagedKVCache(
        key=flat[:half].view(shape),
        value=flat[half:].view(shape),
        block_size=spec.block_size,
        layout=layout,
        kv_cache_dtype=spec.kv_cache_dtype,
    )
