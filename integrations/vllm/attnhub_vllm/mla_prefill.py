"""An MLA layer's expanded prefill (vLLM's ``forward_mha``) through an attnhub backend's
standard impl, as vendors run it on hardware (vllm-ascend: FIA in TND with keys 192 and values
128; vLLM's ``FLASH_ATTN_MLA``: the varlen kernel with a value head size of its own).

The expanded form is ordinary causal multi-head attention whose value head size differs from
the key head size (docs/mla.md): keys ``[k_nope ; k_pe]`` (``qk_nope + rope`` wide) and values
(``v_head_dim``), both from the layer's ``kv_b_proj``, one kv head per query head. Its
:class:`~attnhub.AttentionSpec` is :func:`expanded_spec`. attnhub's standard API is paged, so
the keys and values go into a transient cache made for the layer's call and dropped after it
(activation memory, like vLLM's own ``k`` / ``v`` and its context workspace; nothing kept
between layers or steps): every prefill request in blocks of its own, its cached context (if
any) at positions ``0..context_len - 1`` and its new tokens after it, so the backend's causal
attention (bottom-right) is the prefill's whole attention in one call.

Cached context (a chunked prefill's earlier chunks, a prefix-cache hit: vLLM's
``chunked_context``) is read from the layer's latent cache through attnhub
(``attnhub.kit.read_latent_rows``: either layout, fp8 dequantized with the cache's scale as
vLLM's ``gather_and_maybe_dequant_cache`` does), expanded by the layer's ``kv_b_proj`` exactly
as vLLM's ``_compute_prefill_context`` expands it, and written into the transient cache before
the new tokens. Memory is bounded as vLLM bounds its own: the step's prefills are cut into
calls whose contexts sum to at most vLLM's chunked-prefill workspace (``max_context_rows``,
``MLACommonMetadataBuilder.chunked_prefill_workspace_size``), consecutive requests per call; a
request whose context alone exceeds it gets a call of its own, its context whole (vLLM splits
such a request and merges by LSE; the bound here is then that request's context: at most
``max_model_len`` rows). Context sharded over a decode context parallel group is not read
here (:func:`context_refusal`).

Which path serves a layer's prefill is decided once, when the impl binds its spec
(:func:`prefill_route`): the attnhub backend that serves the layer's decode, for the expanded
spec, or, where that backend refuses it (``unsupported_reasons``) but its MLA impl serves
queries of every length, the absorbed form through that impl (:func:`forward_absorbed`: the
latents of context and new tokens read by the impl from the latent cache itself), else vLLM's
own ``forward_mha`` with the backend's reason, logged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnhub import AttentionSpec, BatchMetadata, LatentKVCache, MLASpec
from attnhub.errors import AttnhubError, UnsupportedConfigurationError
from attnhub.kit import read_latent_rows
from attnhub_vllm.backend import describe_spec

#: What the log says of a layer whose prefill is vLLM's own.
VLLM_OWN = "vLLM's own (MLACommonBaseImpl.forward_mha)"


def expanded_spec(spec: MLASpec, block_size: int | None = None) -> AttentionSpec:
    """The standard spec of ``spec``'s expanded form: keys ``qk_nope + rope`` wide, values
    ``v_head_dim``, one kv head per query head, causal, the MLA layer's scale and dtype, blocks
    of ``block_size`` (the transient cache's; default the latent cache's)."""
    return AttentionSpec(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_heads,
        head_size=spec.qk_head_dim,
        head_size_v=spec.v_head_dim,
        dtype=spec.dtype,
        block_size=spec.block_size if block_size is None else block_size,
        scale=spec.scale,
    )


@dataclass(frozen=True)
class PrefillRoute:
    """Who serves an MLA layer's prefill: ``backend`` (an attnhub backend bound to the
    expanded spec), or ``absorbed`` (the layer's attnhub MLA backend, whose MLA impl serves
    queries of every length: the absorbed form over the latent cache), or, where both are
    None, vLLM's own ``forward_mha``; ``why`` says which and why (what the adapter logs)."""

    backend: Any
    why: str
    absorbed: Any = None

    @property
    def attnhub(self) -> bool:
        """attnhub serves the prefill (either form)."""
        return self.backend is not None or self.absorbed is not None

    @property
    def spec(self) -> AttentionSpec | None:
        return None if self.backend is None else self.backend.spec


def _block_sizes(backend: Any, spec: MLASpec) -> list[int]:
    """The transient cache's block size candidates, best first: the latent cache's, then the
    declared ones (the transient cache is the adapter's own: any block size the backend
    serves does)."""
    caps = backend.capabilities
    sizes = [spec.block_size, *sorted(caps.block_sizes or ())]
    if caps.block_size_multiple:
        sizes.append(caps.block_size_multiple)
    return list(dict.fromkeys(sizes))


def prefill_route(
    mla_backend: Any,
    spec: MLASpec,
    device: torch.device | str,
    emulate: bool,
    *,
    prefill_query_quantization: bool = False,
    sharded_context: bool = False,
    context_parallel: bool = False,
) -> PrefillRoute:
    """Decide once, for an MLA layer of ``spec`` whose decode ``mla_backend`` serves, who
    serves its expanded prefill: that backend for :func:`expanded_spec` (the first block size
    it serves), or vLLM's own ``forward_mha`` with the backend's reasons.
    ``prefill_query_quantization``: vLLM quantizes the prefill's query (and keys, values) to
    fp8 (``use_prefill_query_quantization`` with an fp8 cache): not mapped, vLLM's own.
    ``sharded_context``: prefills may come with cached context (chunked prefill or prefix
    caching on) while decode context parallel shards the latent cache over ranks: vLLM's own,
    which gathers that context over the group (``_context_parallel_compute_prefill_context``);
    the adapter reads a rank's own cache. Where the backend refuses the expanded spec but its
    MLA impl serves queries of every length (``Capabilities.mla.max_query_len`` None), the
    absorbed form serves the prefill, unless ``context_parallel`` (decode context parallel:
    a rank's latent cache holds a shard of the prefill's own tokens too)."""
    if sharded_context:
        return PrefillRoute(
            None,
            f"{VLLM_OWN}: prefills may come with cached context (enable_chunked_prefill or "
            "enable_prefix_caching is on) sharded over the decode context parallel group, "
            "which the adapter's expanded prefill does not gather",
        )
    if prefill_query_quantization:
        return PrefillRoute(
            None,
            f"{VLLM_OWN}: vLLM's fp8 prefill (use_prefill_query_quantization with an fp8 "
            "cache) is not mapped",
        )
    cls = type(mla_backend)
    block = spec.block_size
    for size in _block_sizes(mla_backend, spec):
        if not any(
            r.field == "block_size" for r in cls.unsupported_reasons(expanded_spec(spec, size))
        ):
            block = size
            break
    want = expanded_spec(spec, block)
    # the MLA layer's own backend class (for flash: its provider, whatever the registry's
    # default), made for the expanded spec; its refusal names what it cannot serve
    try:
        backend = cls(want, device, emulate=emulate or bool(getattr(mla_backend, "emulate", False)))
    except AttnhubError as exc:
        why = (
            f"attnhub backend {mla_backend.name} cannot serve this vLLM {describe_spec(want)}: "
            f"{exc}"
        )
        if not context_parallel and mla_backend.capabilities.mla.max_query_len is None:
            return PrefillRoute(
                None,
                f"attnhub (the absorbed form: the MLA impl of backend {mla_backend.name!r} over "
                "the latent cache, cached context included, the query absorbed by W_UK and the "
                f"latent output projected by W_UV, as vLLM's AMX_MLA does; the expanded form "
                f"refused: {why})",
                absorbed=mla_backend,
            )
        return PrefillRoute(None, f"{VLLM_OWN}: {why}")
    return PrefillRoute(
        backend,
        f"attnhub (the expanded form: heads {want.num_heads}, head_size {want.head_size}, "
        f"head_size_v {want.head_size_v}, {str(want.dtype).removeprefix('torch.')}, causal; "
        f"a transient cache of block {want.block_size} per call; cached context read from the "
        "latent cache and expanded by kv_b_proj)",
    )


@dataclass(frozen=True)
class PrefillChunk:
    """One attention call of a step's prefills (consecutive requests), all host work done:
    ``meta`` (the attnhub metadata of their new tokens in the transient cache, each request's
    cached context before them), ``num_blocks`` (that cache's), ``tokens`` (their rows of the
    step's prefill tokens); where some has cached context, ``context`` (the attnhub metadata of
    the context rows' write into the transient cache, slots checked once in build) and
    ``context_slots`` ([n] int64: where the latent cache holds those rows, in that order)."""

    meta: Any
    num_blocks: int
    tokens: slice
    context: Any = None
    context_slots: torch.Tensor | None = None

    @property
    def batch(self) -> BatchMetadata:
        return self.meta.batch


@dataclass(frozen=True)
class PrefillStep:
    """One step's prefills as attention calls over transient caches (built once per step,
    read by every layer)."""

    chunks: tuple[PrefillChunk, ...]

    @property
    def num_blocks(self) -> int:
        """The largest transient cache of the step (one lives at a time)."""
        return max((c.num_blocks for c in self.chunks), default=0)


def plan_calls(context_lens: list[int], max_context_rows: int | None) -> list[tuple[int, int]]:
    """The step's prefill requests ``[first, end)`` per attention call: consecutive requests
    while their contexts sum to at most ``max_context_rows`` (None: no bound, one call); a
    request whose context alone exceeds it in a call of its own."""
    calls: list[tuple[int, int]] = []
    first, rows = 0, 0
    for r, n in enumerate(context_lens):
        if max_context_rows is not None and r > first and rows + n > max_context_rows:
            calls.append((first, r))
            first, rows = r, 0
        rows += n
    if context_lens:
        calls.append((first, len(context_lens)))
    return calls


def prefill_batch(
    query_lens_cpu: torch.Tensor,
    block_size: int,
    device: torch.device | str,
    context_lens_cpu: torch.Tensor | None = None,
) -> tuple[BatchMetadata, int, BatchMetadata | None]:
    """The ``BatchMetadata`` of prefills in a transient cache of their own (each request in
    its own consecutive blocks, its cached context at positions ``0..context_len - 1``, its
    new tokens after it); that cache's block count; and, where some request has context, the
    ``BatchMetadata`` whose new tokens are those requests' context rows (their write)."""
    q = query_lens_cpu.to(torch.int64)
    c = torch.zeros_like(q) if context_lens_cpu is None else context_lens_cpu.to(torch.int64)
    seq = q + c
    blocks = (seq + block_size - 1) // block_size  # [num_prefills]
    first = torch.cumsum(blocks, 0) - blocks
    width = max(int(blocks.max()), 1) if blocks.numel() else 1
    cols = torch.arange(width)
    table = torch.where(cols[None, :] < blocks[:, None], first[:, None] + cols[None, :], 0)
    table = table.to(torch.int32)
    batch = BatchMetadata.from_lengths(q, seq, table, block_size, device)
    has = c > 0
    context = None
    if bool(has.any()):  # the context rows as the "new tokens" of their own write
        context = BatchMetadata.from_lengths(c[has], c[has], table[has], block_size, device)
    return batch, int(blocks.sum()), context


def context_slots(
    block_table: torch.Tensor,  # [num_prefills, max_blocks] the latent cache's (vLLM's)
    context_lens: list[int],
    block_size: int,  # the latent cache's
) -> torch.Tensor:  # [sum(context_lens)] int64, on block_table's device
    """The latent-cache slot of every context position ``0..context_len - 1`` of each request,
    request by request (the order :func:`prefill_batch`'s context write takes)."""
    lens = torch.tensor(context_lens, dtype=torch.int64)
    req = torch.repeat_interleave(torch.arange(len(context_lens)), lens)
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(
        torch.cumsum(lens, 0) - lens, lens
    )
    dev = block_table.device
    req, pos = req.to(dev), pos.to(dev)
    return block_table[req, pos // block_size].long() * block_size + pos % block_size


def build_prefill_step(
    builder: Any,
    query_lens_cpu: torch.Tensor,
    device: Any,
    *,
    context_lens: list[int] | None = None,
    block_table: torch.Tensor | None = None,
    latent_block_size: int | None = None,
    max_context_rows: int | None = None,
) -> PrefillStep:
    """``builder.build`` (the expanded spec's attnhub builder) of a step's prefills, cut into
    calls (:func:`plan_calls`). With cached context: ``context_lens`` (per prefill, host),
    ``block_table`` (vLLM's prefill rows of the latent cache's table) and
    ``latent_block_size``."""
    n = int(query_lens_cpu.numel())
    ctx = [0] * n if context_lens is None else list(context_lens)
    block = builder.backend.spec.block_size
    tokens = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), query_lens_cpu.long()]), 0)
    chunks = []
    for a, b in plan_calls(ctx, max_context_rows):
        lens = torch.tensor(ctx[a:b], dtype=torch.int64)
        batch, num_blocks, context = prefill_batch(query_lens_cpu[a:b], block, device, lens)
        slots = None
        if context is not None:
            assert block_table is not None and latent_block_size is not None
            own = [i for i in range(a, b) if ctx[i] > 0]
            slots = context_slots(block_table[own], [ctx[i] for i in own], latent_block_size)
        chunks.append(
            PrefillChunk(
                builder.build(batch),
                num_blocks,
                slice(int(tokens[a]), int(tokens[b])),
                None if context is None else builder.build(context),
                slots,
            )
        )
    return PrefillStep(tuple(chunks))


def context_refusal(prefill: Any, num_decodes: int, backend: str, dcp_world_size: int) -> None:
    """Raise (UnsupportedConfigurationError naming the request) where a prefill of the step
    (vLLM's ``MLACommonPrefillMetadata``) has cached context sharded over a decode context
    parallel group (``dcp_world_size`` > 1): a rank's latent cache holds part of it, and the
    adapter reads that cache alone (an engine that may send such context keeps vLLM's own
    prefill: :func:`prefill_route`'s ``sharded_context``)."""
    chunked = getattr(prefill, "chunked_context", None)
    if chunked is None or dcp_world_size <= 1:
        return
    for i, n in enumerate(chunked.context_lens_list):
        if n > 0:
            raise UnsupportedConfigurationError(
                backend,
                [
                    f"MLA prefill request {i} of the step (request {num_decodes + i} of the "
                    f"batch) has {n} tokens of cached context sharded over {dcp_world_size} "
                    "decode context parallel ranks: the adapter's expanded prefill reads "
                    "this rank's latent cache only"
                ],
            )


#: ``kv_b_proj``'s expansion of latents ``(kv_c [n, kv_lora_rank], k_pe [n, rope])`` into
#: keys [n, H, qk_nope + rope] and values [n, H, v_head_dim] (the layer's own).
Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def forward_expanded(
    route: PrefillRoute,
    q: torch.Tensor,  # [num_prefill_tokens, H, qk_nope + rope]
    k: torch.Tensor,  # [num_prefill_tokens, H, qk_nope + rope]
    v: torch.Tensor,  # [num_prefill_tokens, H, v_head_dim]
    step: PrefillStep,
    output: torch.Tensor,  # [num_prefill_tokens, H, v_head_dim]
    latent: LatentKVCache | None = None,
    expand: Expand | None = None,
) -> torch.Tensor:
    """One layer's expanded prefill through ``route.backend``'s standard impl, call by call
    (``step.chunks``): the call's cached context read from ``latent`` and expanded by
    ``expand``, written into a transient cache of the call's blocks, then its new tokens'
    ``k`` / ``v`` written and attended into ``output``. Each cache and impl (which remembers
    the last cache it checked) is made for its call and dropped after it (an impl costs about
    a microsecond to make)."""
    backend = route.backend
    assert backend is not None
    for chunk in step.chunks:
        cache = backend.allocate_kv_cache(chunk.num_blocks)
        impl = backend.impl()
        if chunk.context is not None:
            assert latent is not None and expand is not None and chunk.context_slots is not None
            kv_c, k_pe = read_latent_rows(latent, chunk.context_slots, backend.spec.dtype)
            k_ctx, v_ctx = expand(kv_c, k_pe)
            impl.write_kv(k_ctx, v_ctx, cache, meta=chunk.context)
            del kv_c, k_pe, k_ctx, v_ctx
        t = chunk.tokens
        impl.forward(q[t], k[t], v[t], cache, chunk.meta, output=output[t])
        del cache, impl
    return output


def absorbed_batch(
    query_lens_cpu: torch.Tensor,
    context_lens: list[int] | None,
    block_table: torch.Tensor,  # [num_prefills, max_blocks] the latent cache's (vLLM's)
    block_size: int,
    device: torch.device | str,
) -> BatchMetadata:
    """The ``BatchMetadata`` of a step's prefills over the latent cache itself (the absorbed
    form): each request's new tokens after its cached context, vLLM's block table (the slots
    are the ones vLLM wrote the new latents to)."""
    q = query_lens_cpu.to(torch.int64)
    ctx = torch.zeros_like(q) if context_lens is None else torch.tensor(context_lens)
    table = block_table.to("cpu", torch.int32)
    return BatchMetadata.from_lengths(q, q + ctx, table, block_size, device)


def forward_absorbed(
    impl: Any,  # the layer's attnhub MLA impl
    q: torch.Tensor,  # [num_prefill_tokens, H, qk_nope + rope]
    latent: LatentKVCache,  # the step's latents already written (do_kv_cache_update)
    meta: Any,  # the MLA builder's metadata of ``absorbed_batch``
    w_uk: torch.Tensor,  # [kv_lora_rank, H, qk_nope]
    w_uv: torch.Tensor,  # [kv_lora_rank, H, v_head_dim]
    output: torch.Tensor,  # [num_prefill_tokens, H, v_head_dim]
) -> torch.Tensor:
    """One layer's prefill in the absorbed form: ``[q_nope @ W_UK ; q_pe]`` attended by the MLA
    impl over the latent cache (the context and the new tokens, causal), the latent output
    projected by ``W_UV`` into ``output`` (vLLM's ``AMXMLAImpl.forward_mha`` computes the same:
    absorb, ``extend_attention_cpu``, de-absorb)."""
    nope = w_uk.shape[2]
    q_nope, q_pe = q.split([nope, q.shape[2] - nope], dim=-1)
    ql_nope = torch.einsum("thp,lhp->thl", q_nope, w_uk)  # [T, H, kv_lora_rank]
    out = impl.forward(torch.cat([ql_nope, q_pe], dim=-1), None, None, latent, meta)
    output.copy_(torch.einsum("thl,lhv->thv", out, w_uv))
    return output


def transient_bytes(spec: AttentionSpec, num_blocks: int) -> int:
    """The transient cache's bytes for ``num_blocks`` blocks of ``spec``."""
    per_slot = spec.num_kv_heads * (spec.head_size + spec.head_size_v) * spec.dtype.itemsize
    return num_blocks * spec.block_size * per_slot


__all__ = [
    "VLLM_OWN",
    "Expand",
    "PrefillChunk",
    "PrefillRoute",
    "PrefillStep",
    "absorbed_batch",
    "build_prefill_step",
    "context_refusal",
    "context_slots",
    "expanded_spec",
    "forward_absorbed",
    "forward_expanded",
    "plan_calls",
    "prefill_batch",
    "prefill_route",
    "transient_bytes",
]
