"""vLLM -> attnhub translations that need no vLLM import (unit-testable anywhere).

- :func:`batch_from_common`: vLLM's ``CommonAttentionMetadata`` (duck-typed) -> ``BatchMetadata``,
  once per step, with tensor slicing only (no per-request Python loop).
- :func:`spec_from_vllm`: a vLLM attention layer's arguments -> ``AttentionSpec``, or the list of
  reasons the adapter itself refuses (features it does not map).
- :func:`cache_views`: vLLM's per-layer KV tensor (logical ``[B, H, N, 2*D]``, K then V in the
  last dim) -> ``PagedKVCache`` views in the backend's layout, without copying.
- :func:`cache_pages`: the same memory as one row per block (a page), for backends that lay a
  block out in their kernels' own layout (``AttentionBackend.kv_cache_from_pages``).
- :func:`cache_planes`: the same memory as two contiguous K and V planes, for backends whose
  kernels refuse strided planes.
- MLA layers: :func:`mla_spec_from_vllm` (an ``MLAAttention``'s arguments -> ``MLASpec``),
  :func:`decode_batch` (the decode requests a step's ``forward_mqa`` attends for) and
  :func:`latent_cache` (vLLM's joint latent plane as a ``LatentKVCache``, no copy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from attnhub import AttentionSpec, BatchMetadata, PagedKVCache
from attnhub.errors import AttnhubError
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.spec import KV_CACHE_DTYPES as KV_CACHE_FORMATS
from attnhub.spec import AttentionType


class AttnhubConfigurationError(AttnhubError, ValueError):
    """vLLM asks for something attnhub-vllm or the chosen attnhub backend cannot serve
    (raised at engine start where it can be known then)."""


#: vLLM ``cache_dtype`` -> attnhub ``kv_cache_dtype``. vLLM's fp8 caches store fp8(x / scale)
#: with one per-tensor scale per layer and plane (``layer._k_scale`` / ``layer._v_scale``), as
#: attnhub's fp8 formats do: the adapter hands those very tensors over as the scale planes.
KV_CACHE_DTYPES = {
    "auto": "auto",
    "bfloat16": "auto",
    "float16": "auto",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}

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
            f"(mapped: {', '.join(KV_CACHE_DTYPES)})"
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


#: vLLM ``cache_dtype`` -> attnhub latent ``kv_cache_dtype`` for MLA layers: the model dtype,
#: or fp8 latents with the layer's one ``_k_scale`` (what vLLM's ``concat_and_cache_mla``
#: writes; ``"fp8"`` is e4m3). vLLM allocates fp8 caches as uint8: ``latent_cache`` views the
#: plane in the fp8 dtype. The query stays in the model dtype (the adapter's impl sets
#: ``supports_quant_query_input = False``, as vLLM's CPU_MLA does). Whether the chosen backend
#: serves an fp8 latent is its ``Capabilities.mla.kv_cache_dtypes`` (refused at engine start).
MLA_KV_CACHE_DTYPES = {
    "auto": "auto",
    "bfloat16": "auto",
    "float16": "auto",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
}


def mla_spec_from_vllm(
    *,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    scale: float,
    kv_cache_dtype: str = "auto",
    attn_type: str = "decoder",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    use_alibi: bool = False,
) -> tuple[MLASpec | None, list[str]]:
    """The attnhub spec of one vLLM MLA layer (``MLAAttention``'s arguments), or None and the
    adapter's reasons."""
    reasons = []
    attn_type = str(getattr(attn_type, "value", attn_type))
    if attn_type != "decoder":
        reasons.append(f"vLLM MLA attention type {attn_type!r}: MLA layers are decoders")
    if kv_cache_dtype not in MLA_KV_CACHE_DTYPES:
        reasons.append(
            f"vLLM kv_cache_dtype {kv_cache_dtype!r} is not mapped for MLA layers by "
            f"attnhub-vllm (mapped: {', '.join(MLA_KV_CACHE_DTYPES)})"
        )
    if sliding_window is not None and sliding_window >= 0:
        reasons.append(f"an MLA layer with sliding_window {sliding_window} is not mapped")
    if logits_soft_cap:
        reasons.append(f"an MLA layer with logits_soft_cap {logits_soft_cap} is not mapped")
    if use_alibi:
        reasons.append("an MLA layer with ALiBi slopes is not mapped")
    if reasons:
        return None, reasons
    try:
        spec = MLASpec(
            num_heads=num_heads,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            qk_nope_head_dim=qk_nope_head_dim,
            v_head_dim=v_head_dim,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=MLA_KV_CACHE_DTYPES[kv_cache_dtype],
            scale=scale,
        )
    except Exception as exc:  # the spec validates itself; surface its message
        return None, [f"invalid MLA spec: {exc}"]
    return spec, []


def decode_batch(
    cm: Any, block_size: int, num_decodes: int, num_decode_tokens: int
) -> BatchMetadata:
    """The ``BatchMetadata`` of a step's first ``num_decodes`` requests (vLLM's MLA builders
    put decodes first: ``reorder_batch_threshold``), their ``num_decode_tokens`` query tokens
    and slots: what an MLA layer's ``forward_mqa`` attends for."""
    batch = batch_from_common(cm, block_size, num_reqs=num_decodes)
    slots, slots_cpu = batch.slot_mapping, batch.slot_mapping_cpu
    if slots.shape[0] == num_decode_tokens:
        return batch
    return dataclasses.replace(
        batch,
        slot_mapping=slots[:num_decode_tokens],
        slot_mapping_cpu=None if slots_cpu is None else slots_cpu[:num_decode_tokens],
    )


def latent_cache(
    kv_cache: torch.Tensor,
    spec: MLASpec,
    scale: torch.Tensor | None = None,
    layout: str = "joint",
) -> LatentKVCache:
    """attnhub's latent cache over vLLM's MLA cache tensor of one layer, ``[num_blocks,
    block_size, kv_lora_rank + qk_rope_head_dim]`` (``MLAAttention.kv_cache``), no copy:

    - ``layout`` "joint": vLLM's plane as it is (``LatentKVCache.from_joint``), what vLLM's own
      kernels read;
    - ``layout`` "split": the same memory reinterpreted as two dense planes, every block's
      ``kv_c`` [num_blocks, block_size, kv_lora_rank] first, then every block's ``k_pe``
      [num_blocks, block_size, qk_rope_head_dim] (for backends whose kernels read the nope and
      rope parts apart: ``ascend``). Page ``b`` of vLLM's tensor then no longer holds block
      ``b``'s latents in vLLM's joint layout, so nothing in vLLM may read it as such
      (:func:`mla_layout_refusal` says when that holds).

    An fp8 spec: vLLM's uint8 (or ``float8_e4m3fn``, as ``MLAAttention.forward_impl`` views it
    whatever the fp8 format) plane viewed in the spec's fp8 dtype (the same bytes), ``scale``
    the layer's ``_k_scale`` (a float32 scalar, shared: vLLM's calibrated value as it is now)."""
    quantized = KV_CACHE_FORMATS[spec.kv_cache_dtype].is_quantized
    if quantized:
        storage = _latent_storage(spec)
        if kv_cache.dtype != storage and kv_cache.element_size() == storage.itemsize:
            kv_cache = kv_cache.view(storage)
    else:
        scale = None
    kv = spec.kv_cache_dtype if quantized else "auto"
    if layout == "joint":
        return LatentKVCache.from_joint(kv_cache, spec.kv_lora_rank, kv_cache_dtype=kv, scale=scale)
    if layout != "split":
        raise AttnhubConfigurationError(f"latent layout {layout!r} is not 'joint' or 'split'")
    num_blocks, n = int(kv_cache.shape[0]), int(kv_cache.shape[1])
    r, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    if kv_cache.dim() != 3 or kv_cache.shape[2] != r + rope or not kv_cache.is_contiguous():
        raise AttnhubConfigurationError(
            f"attnhub-vllm carves split latent planes from vLLM's MLA cache only where it is "
            f"one dense [num_blocks, block_size, {r + rope}] run; got shape "
            f"{list(kv_cache.shape)}, strides {kv_cache.stride()}"
        )
    flat = kv_cache.view(-1)
    edge = num_blocks * n * r
    return LatentKVCache(
        kv_c=flat[:edge].view(num_blocks, n, r),
        k_pe=flat[edge:].view(num_blocks, n, rope),
        block_size=n,
        layout="split",
        kv_cache_dtype=kv,
        scale=scale,
    )


def _latent_storage(spec: MLASpec) -> torch.dtype:
    """The storage dtype of an fp8 latent of ``spec``."""
    storage, _ = KV_CACHE_FORMATS[spec.kv_cache_dtype].storage_dtypes(spec.dtype)
    return storage


def prefill_context_sources(vllm_config: Any) -> list[str]:
    """What in vLLM's engine config (a ``VllmConfig``, read duck-typed) can give a prefill a
    cached context, which vLLM's own ``forward_mha`` gathers from the layer's cache in the
    joint layout (``_compute_prefill_context``, run when the step's
    ``prefill.chunked_context`` is set), or anything else in vLLM that reads or moves the
    cache's pages by block id; [] when the config rules all of it out. vLLM's CPU platform
    turns chunked prefill and prefix caching off for MLA models wherever it does not pick
    ``AMX_MLA`` (``CpuPlatform.check_and_update_config``): there this is []. A setting the
    config does not have counts as on."""
    reasons = []
    scheduler = getattr(vllm_config, "scheduler_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(scheduler, "enable_chunked_prefill", True):
        reasons.append(
            "chunked prefill is on (a prompt's later chunks attend to its earlier ones in the "
            "cache)"
        )
    if getattr(cache, "enable_prefix_caching", True):
        reasons.append("prefix caching is on (a prompt's cached prefix is its context)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        reasons.append(
            "speculative decoding is on (a step's several tokens per request over its cached "
            "context can run as a prefill)"
        )
    return reasons + page_moving_sources(vllm_config)


def page_moving_sources(vllm_config: Any) -> list[str]:
    """What in vLLM's engine config reads or moves the cache's pages by block id, whoever
    serves the prefill (a KV connector, KV offloading): latents kept other than as vLLM's joint
    plane would be moved wrong. [] when the config has none."""
    reasons = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        reasons.append(
            "a KV connector is configured (it loads a prompt's context into the cache and "
            "moves pages by block id)"
        )
    if getattr(getattr(vllm_config, "cache_config", None), "kv_offloading_size", None):
        reasons.append("KV offloading is on (it moves pages by block id)")
    return reasons


def mla_layout_refusal(
    backend: str, layouts: tuple[str, ...], prefill_context: list[str] | None = None
) -> str | None:
    """Why the adapter cannot run backend ``backend``'s MLA kernels, which read latent caches
    in ``layouts`` (``Capabilities.mla.layouts``), or None. The adapter keeps the latents in
    vLLM's own per-layer cache memory, no copy: as vLLM's joint plane where the backend reads
    "joint"; else, for a backend that reads "split" planes, as the two planes carved from that
    memory in place (:func:`latent_cache`), which is sound only while nothing in vLLM reads the
    memory in the joint layout: vLLM does so in ``forward_mha``'s context gather (a prefill
    with cached context). ``prefill_context``: what in the engine config can give a prefill
    a cached context (:func:`prefill_context_sources`; None: unknown, i.e. possible); the
    split planes are allowed exactly when it is []."""
    if "joint" in layouts:
        return None
    if "split" not in layouts:
        return (
            f"attnhub-vllm serves MLA layers in vLLM's own latent cache memory, as its joint "
            f"plane or as split planes carved from it in place; backend {backend!r} reads "
            f"latent layouts {', '.join(layouts)} only"
        )
    if prefill_context == []:
        return None
    why = (
        "; ".join(prefill_context)
        if prefill_context
        else "the engine config is unknown, so a prefill may have cached context"
    )
    return (
        f"attnhub-vllm serves MLA layers in vLLM's own latent cache memory; backend "
        f"{backend!r} reads latent layouts {', '.join(layouts)} only, and split planes carved "
        f"in place from vLLM's joint plane are sound only while vLLM never reads that memory "
        f"as its joint plane, which its prefill does over cached context (forward_mha's "
        f"context gather); this engine can give a prefill cached context: {why}"
    )


def refuse_split_prefill_context(split_layers: list[str], prefill: Any) -> None:
    """Raise where a step's prefill metadata (vLLM's ``MLACommonMetadata.prefill``, read
    duck-typed) has cached context (``chunked_context``: vLLM's ``forward_mha`` will gather it
    from the cache in the joint layout) while ``split_layers`` keep split latent planes in
    vLLM's memory; the engine config rules this out where those layers were allowed
    (:func:`mla_layout_refusal`), so this only stops a step that comes anyway."""
    if split_layers and getattr(prefill, "chunked_context", None) is not None:
        raise AttnhubConfigurationError(
            f"attnhub-vllm: a prefill with cached context in a step of MLA layers "
            f"{', '.join(split_layers)}, whose latents are split planes in vLLM's memory "
            "(vLLM's forward_mha would read that context as its joint plane)"
        )


def real_requests(cm: Any) -> int:
    """How many of ``cm``'s requests are real: vLLM pads a FULL cudagraph step's batch to the
    graph's request count with requests of no query token and no sequence (its
    ``query_start_loc`` repeats the last real end; ``_dummy_run`` / ``_build_attention_metadata``),
    after every real one. Read on the host copy."""
    n = int(cm.num_reqs)
    qsl = cm.query_start_loc_cpu.numpy()[: n + 1]
    return int(np.searchsorted(qsl, qsl[n], side="left")) if n else 0


def batch_from_common(
    cm: Any, block_size: int, *, exact_maxima: bool = False, num_reqs: int | None = None
) -> BatchMetadata:
    """One step's ``BatchMetadata`` from vLLM's ``CommonAttentionMetadata``.

    Slices only, and only where vLLM's persistent buffers are longer than the batch. Host
    copies come from ``query_start_loc_cpu`` and, for the sequence lengths, from ``seq_lens``
    itself when it lives on the host (the CPU platform), else ``seq_lens_cpu_upper_bound``
    (exact outside async speculative decoding), else one device-to-host copy per step (never
    per layer). On an accelerator, the block table and slot mapping attnhub's builders check
    are copied to the host once per step too (vLLM's CommonAttentionMetadata carries no host
    copy of them); on the CPU platform they are host tensors already.

    ``exact_maxima``: take vLLM's own ``max_query_len`` / ``max_seq_len`` (it computes them
    from the same host arrays; exact unless speculative decoding makes ``max_seq_len`` an
    optimistic bound) instead of reducing the lengths again. attnhub's ``build`` checks them
    against the lengths either way, and refuses a wrong one with a typed error naming it.
    ``num_actual_tokens`` always comes from ``query_start_loc`` (vLLM's may count padding).
    ``num_reqs``: the first requests only (:func:`real_requests` of a padded step; then
    ``exact_maxima`` is ignored: vLLM's maxima may count the padding).
    """
    n = int(cm.num_reqs) if num_reqs is None else num_reqs
    if num_reqs is not None:
        exact_maxima = False
    qsl_cpu = cm.query_start_loc_cpu
    if qsl_cpu.shape[0] != n + 1:
        qsl_cpu = qsl_cpu[: n + 1]
    qsl = cm.query_start_loc
    if qsl.shape[0] != n + 1:
        qsl = qsl[: n + 1]
    seq = cm.seq_lens
    if seq.shape[0] != n:
        seq = seq[:n]
    if seq.is_cpu:
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
    if causal is not True and causal is not False:
        if isinstance(causal, torch.Tensor):
            raise AttnhubConfigurationError(
                "attnhub-vllm: per-request (tensor) causal flags are not mapped to attnhub"
            )
        causal = bool(causal)
    if not n:
        num_actual = max_q = max_s = 0
    elif exact_maxima:
        num_actual = int(qsl_cpu.numpy()[n])
        max_q, max_s = int(cm.max_query_len), int(cm.max_seq_len)
    else:  # numpy on the host copies: ~1 us per reduction where a torch op costs ~3-5 us
        qsl_np = qsl_cpu.numpy()
        num_actual = int(qsl_np[n])
        max_q = int((qsl_np[1:] - qsl_np[:-1]).max())
        max_s = int(seq_cpu.numpy().max())
    table = cm.block_table_tensor
    if table.shape[0] != n:
        table = table[:n]
    slots = cm.slot_mapping
    on_host = table.is_cpu
    return BatchMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl_cpu,
        seq_lens=seq,
        seq_lens_cpu=seq_cpu,
        num_reqs=n,
        num_actual_tokens=num_actual,
        max_query_len=max_q,
        max_seq_len=max_s,
        block_table=table,
        slot_mapping=slots,
        block_size=block_size,
        causal=causal,
        block_table_cpu=None if on_host else table.to("cpu"),
        slot_mapping_cpu=None if on_host else slots.to("cpu"),
    )


def cache_views(
    kv_cache: torch.Tensor,
    spec: AttentionSpec,
    layout: str,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PagedKVCache:
    """attnhub views of vLLM's per-layer cache ``[num_blocks, num_kv_heads, block_size, 2*D]``
    (logical axes; the physical order is whatever layout vLLM allocated): keys are
    ``[..., :D]``, values ``[..., D:]``. No copy; the views are strided (K and V interleave
    per slot). fp8 caches (vLLM allocates them as uint8) are viewed in the fp8 dtype, with
    ``scales`` = the layer's (k_scale, v_scale)."""
    d = spec.head_size
    # NHD: [B, N, H, 2D]; HND: vLLM's logical order [B, H, N, 2D] as it is
    t = _as_storage(kv_cache, spec)
    t = t.permute(0, 2, 1, 3) if layout == "NHD" else t
    return _paged(t[..., :d], t[..., d:], spec, layout, scales)


def _as_storage(kv_cache: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """vLLM's tensor in attnhub's storage dtype for the spec (uint8 -> fp8: same bytes)."""
    storage, _ = KV_CACHE_FORMATS[spec.kv_cache_dtype].storage_dtypes(spec.dtype)
    if kv_cache.dtype == storage or kv_cache.element_size() != storage.itemsize:
        return kv_cache  # (a mismatch is reported by the backend's cache check)
    return kv_cache.view(storage)


def _paged(
    key: torch.Tensor,
    value: torch.Tensor,
    spec: AttentionSpec,
    layout: str,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> PagedKVCache:
    key_scale, value_scale = (None, None) if scales is None else scales
    if not KV_CACHE_FORMATS[spec.kv_cache_dtype].is_quantized:
        key_scale = value_scale = None
    return PagedKVCache(
        key=key,
        value=value,
        block_size=spec.block_size,
        layout=layout,
        kv_cache_dtype=spec.kv_cache_dtype,
        key_scale=key_scale,
        value_scale=value_scale,
    )


def cache_pages(kv_cache: torch.Tensor, spec: AttentionSpec) -> torch.Tensor | None:
    """vLLM's per-layer cache as ``[num_blocks, page]`` in attnhub's storage dtype: row ``b``
    is the memory of block ``b`` (its heads, slots and K|V channels, in whatever order vLLM
    allocated them). None when a block's memory is not one dense run (vLLM's block axis is
    not outermost in memory)."""
    if kv_cache.dim() != 4:
        return None
    strides = kv_cache.stride()
    inner = sorted(range(1, 4), key=lambda i: -strides[i])
    block = kv_cache[0].permute([i - 1 for i in inner]) if kv_cache.shape[0] else None
    if block is None or not block.is_contiguous() or strides[0] < block.numel():
        return None
    t = _as_storage(kv_cache, spec)
    page = block.numel() * kv_cache.element_size() // t.element_size()
    row = strides[0] * kv_cache.element_size() // t.element_size()
    return t.as_strided((t.shape[0], page), (row, 1), t.storage_offset())


def cache_planes(
    kv_cache: torch.Tensor,
    spec: AttentionSpec,
    layout: str,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PagedKVCache | None:
    """Contiguous K and V planes carved from the memory of vLLM's per-layer cache: the first
    half of its elements hold every block's keys, the second half every block's values
    (``[num_blocks, block_size, H, D]`` each for NHD, ``[num_blocks, H, block_size, D]`` for
    HND). For backends whose kernels need contiguous planes; no extra memory. The bytes of
    page ``b`` then no longer hold block ``b`` alone, so anything in vLLM that moves pages by
    block id (KV-transfer connectors, offloading) must not run beside it. None when the
    tensor's memory is not one dense run (vLLM's logical view of it is permuted: any order of
    its axes in memory will do)."""
    strides = kv_cache.stride()
    order = sorted(range(kv_cache.dim()), key=lambda i: -strides[i])
    dense = kv_cache.permute(order)  # the axes in memory order
    if not dense.is_contiguous():
        return None
    num_blocks = kv_cache.shape[0]
    h, n, d = spec.num_kv_heads, spec.block_size, spec.head_size
    flat = _as_storage(dense.view(-1), spec)
    half = num_blocks * n * h * d
    if flat.numel() != 2 * half:
        return None
    shape = (num_blocks, n, h, d) if layout == "NHD" else (num_blocks, h, n, d)
    return _paged(flat[:half].view(shape), flat[half:].view(shape), spec, layout, scales)


def extra_kv_bytes(cache: PagedKVCache | LatentKVCache, kv_cache: torch.Tensor) -> int:
    """Bytes of ``cache``'s planes (K/V, or a latent cache's kv_c / k_pe) that do not lie in
    vLLM's tensor ``kv_cache`` (0 when attnhub works in vLLM's memory, as views or carved
    planes)."""
    storage = kv_cache.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    extra = 0
    planes = (
        (cache.kv_c, cache.k_pe) if isinstance(cache, LatentKVCache) else (cache.key, cache.value)
    )
    seen = set()
    for plane in planes:
        s = plane.untyped_storage()
        if not start <= s.data_ptr() < end and s.data_ptr() not in seen:
            seen.add(s.data_ptr())  # a joint latent cache's two views share one storage
            extra += s.nbytes()
    return extra


#: What ``additional_config={"attnhub": {...}}`` may hold, with the type of each value.
CONFIG_KEYS = {"backend": str, "emulate": bool, "checks": str}
#: What ``"checks"`` may say: what the builders check of each step vLLM builds (the attnhub
#: builder's ``checks``); "full" by default.
STEP_CHECKS = ("full", "structural")


def choice_from_additional_config(additional_config: object) -> tuple[str | None, bool]:
    """(backend name, emulate) from a vLLM config's ``additional_config["attnhub"]``, e.g.
    ``{"backend": "ascend", "emulate": True}``; (None, False) when absent (the environment then
    decides). Raises AttnhubConfigurationError naming a bad key or value."""
    section = additional_config.get("attnhub") if isinstance(additional_config, dict) else None
    if section is None:
        return None, False
    if not isinstance(section, dict):
        raise AttnhubConfigurationError(
            f"additional_config['attnhub'] must be a dict, got {type(section).__name__}"
        )
    for key, value in section.items():
        want = CONFIG_KEYS.get(key)
        if want is None:
            raise AttnhubConfigurationError(
                f"additional_config['attnhub'] has unknown key {key!r} "
                f"(known: {', '.join(CONFIG_KEYS)})"
            )
        if not isinstance(value, want):
            raise AttnhubConfigurationError(
                f"additional_config['attnhub'][{key!r}] = {value!r} must be a {want.__name__}"
            )
    return section.get("backend"), bool(section.get("emulate", False))


def checks_from_additional_config(additional_config: object) -> str:
    """What the adapter's builders check of a step (``AttentionMetadataBuilder.checks``):
    ``additional_config["attnhub"]["checks"]``, "full" (the default: every value of the step
    too) or "structural" (shapes, dtypes and devices only, O(1) per step: vLLM builds every
    step itself, the trade-off its own builders make). Raises AttnhubConfigurationError naming
    a bad key or value."""
    choice_from_additional_config(additional_config)  # the section's keys and types
    section = additional_config.get("attnhub") if isinstance(additional_config, dict) else None
    checks = "full" if section is None else section.get("checks", "full")
    if checks not in STEP_CHECKS:
        raise AttnhubConfigurationError(
            f"additional_config['attnhub']['checks'] = {checks!r} must be one of "
            f"{', '.join(repr(c) for c in STEP_CHECKS)}"
        )
    return str(checks)
