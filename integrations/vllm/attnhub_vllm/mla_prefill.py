"""An MLA layer's expanded prefill (vLLM's ``forward_mha``) through an attnhub backend's
standard impl, as vendors run it on hardware (vllm-ascend: FIA in TND with keys 192 and values
128; vLLM's ``FLASH_ATTN_MLA``: the varlen kernel with a value head size of its own).

The expanded form is ordinary causal multi-head attention whose value head size differs from
the key head size (docs/mla.md): keys ``[k_nope ; k_pe]`` (``qk_nope + rope`` wide) and values
(``v_head_dim``), both from the layer's ``kv_b_proj``, one kv head per query head. Its
:class:`~attnhub.AttentionSpec` is :func:`expanded_spec`. attnhub's standard API is paged, so
the prefill tokens' keys and values go into a transient cache made for the step's prefills and
dropped after the layer's call (activation memory, like vLLM's own ``k`` / ``v``; nothing kept
between layers or steps): every prefill request in blocks of its own, its tokens at positions
``0..query_len - 1``. A prefill here has no cached context: the route is vLLM's own where the
engine may send one (chunked prefill or prefix caching on), and one that comes anyway is
refused by name (:func:`context_refusal`).

Which path serves a layer's prefill is decided once, when the impl binds its spec
(:func:`prefill_route`): the attnhub backend that serves the layer's decode, for the expanded
spec, or, where that backend refuses it (``unsupported_reasons``), vLLM's own ``forward_mha``
with the backend's reason, logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnhub import AttentionSpec, BatchMetadata
from attnhub.errors import AttnhubError, UnsupportedConfigurationError
from attnhub.mla import MLASpec
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
    expanded spec) or, where None, vLLM's own ``forward_mha``; ``why`` says which and why
    (what the adapter logs)."""

    backend: Any
    why: str

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
    cached_context: bool = False,
) -> PrefillRoute:
    """Decide once, for an MLA layer of ``spec`` whose decode ``mla_backend`` serves, who
    serves its expanded prefill: that backend for :func:`expanded_spec` (the first block size
    it serves), or vLLM's own ``forward_mha`` with the backend's reasons.
    ``prefill_query_quantization``: vLLM quantizes the prefill's query (and keys, values) to
    fp8 (``use_prefill_query_quantization`` with an fp8 cache): not mapped, vLLM's own.
    ``cached_context``: the engine may send prefills with cached context (chunked prefill or
    prefix caching on, as vLLM's CPU platform leaves them with ``AMX_MLA``): vLLM's own, which
    reads that context from the latent cache; the transient cache holds a step's tokens only."""
    if cached_context:
        return PrefillRoute(
            None,
            f"{VLLM_OWN}: prefills may come with cached context here (enable_chunked_prefill "
            "or enable_prefix_caching is on), and the adapter's expanded prefill serves "
            "prefills without cached context",
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
        return PrefillRoute(
            None,
            f"{VLLM_OWN}: attnhub backend {mla_backend.name} cannot serve this vLLM "
            f"{describe_spec(want)}: {exc}",
        )
    return PrefillRoute(
        backend,
        f"attnhub (the expanded form: heads {want.num_heads}, head_size {want.head_size}, "
        f"head_size_v {want.head_size_v}, {str(want.dtype).removeprefix('torch.')}, causal; "
        f"a transient cache of block {want.block_size} per step)",
    )


@dataclass(frozen=True)
class PrefillStep:
    """One step's prefills in the transient cache (built once per step, read by every layer):
    the attnhub metadata of ``batch`` and the blocks the cache needs."""

    meta: Any
    num_blocks: int

    @property
    def batch(self) -> BatchMetadata:
        return self.meta.batch


def prefill_batch(
    query_lens_cpu: torch.Tensor, block_size: int, device: torch.device | str
) -> tuple[BatchMetadata, int]:
    """The ``BatchMetadata`` of a step's prefills (no cached context: ``seq_lens`` are the
    query lengths) in a transient cache of their own, each request in its own consecutive
    blocks; and that cache's block count."""
    q = query_lens_cpu.to(torch.int64)
    blocks = (q + block_size - 1) // block_size  # [num_prefills]
    first = torch.cumsum(blocks, 0) - blocks
    width = max(int(blocks.max()), 1) if blocks.numel() else 1
    cols = torch.arange(width)
    table = torch.where(cols[None, :] < blocks[:, None], first[:, None] + cols[None, :], 0)
    batch = BatchMetadata.from_lengths(q, q, table.to(torch.int32), block_size, device)
    return batch, int(blocks.sum())


def build_prefill_step(builder: Any, query_lens_cpu: torch.Tensor, device: Any) -> PrefillStep:
    """``builder.build`` (the expanded spec's attnhub builder) of a step's prefills."""
    batch, num_blocks = prefill_batch(query_lens_cpu, builder.backend.spec.block_size, device)
    return PrefillStep(builder.build(batch), num_blocks)


def context_refusal(prefill: Any, num_decodes: int, backend: str) -> None:
    """Raise (UnsupportedConfigurationError naming the request) where a prefill of the step
    (vLLM's ``MLACommonPrefillMetadata``) has cached context: the transient cache holds only
    the step's own tokens. On CPU vLLM disables chunked prefill and prefix caching for MLA
    models, so none comes; elsewhere this says so rather than attend over half a sequence."""
    chunked = getattr(prefill, "chunked_context", None)
    if chunked is None:
        return
    lens = list(chunked.context_lens_list)
    for i, n in enumerate(lens):
        if n > 0:
            raise UnsupportedConfigurationError(
                backend,
                [
                    f"MLA prefill request {i} of the step (request {num_decodes + i} of the "
                    f"batch) has {n} tokens of cached context: the adapter's expanded prefill "
                    "serves prefills without cached context (chunked prefill and prefix "
                    "caching off, as vLLM's CPU platform sets them for MLA models)"
                ],
            )


def forward_expanded(
    route: PrefillRoute,
    q: torch.Tensor,  # [num_prefill_tokens, H, qk_nope + rope]
    k: torch.Tensor,  # [num_prefill_tokens, H, qk_nope + rope]
    v: torch.Tensor,  # [num_prefill_tokens, H, v_head_dim]
    step: PrefillStep,
    output: torch.Tensor,  # [num_prefill_tokens, H, v_head_dim]
) -> torch.Tensor:
    """One layer's expanded prefill through ``route.backend``'s standard impl: ``k`` / ``v``
    written into a transient cache of ``step.num_blocks`` blocks, then attention into
    ``output``. The cache and the impl (which remembers the last cache it checked) are made
    for the call and dropped on return: nothing outlives it (an impl costs about a
    microsecond to make)."""
    assert route.backend is not None
    cache = route.backend.allocate_kv_cache(step.num_blocks)
    impl = route.backend.impl()
    return impl.forward(q, k, v, cache, step.meta, output=output)


def transient_bytes(spec: AttentionSpec, num_blocks: int) -> int:
    """The transient cache's bytes for ``num_blocks`` blocks of ``spec``."""
    per_slot = spec.num_kv_heads * (spec.head_size + spec.head_size_v) * spec.dtype.itemsize
    return num_blocks * spec.block_size * per_slot


__all__ = [
    "VLLM_OWN",
    "PrefillRoute",
    "PrefillStep",
    "build_prefill_step",
    "context_refusal",
    "expanded_spec",
    "forward_expanded",
    "prefill_batch",
    "prefill_route",
    "transient_bytes",
]
