"""The ``flash`` backend: attnhub's protocol translated into FlashAttention's calling conventions.

One backend name, six providers (``providers.py``: one object each, carrying its
capabilities, refusals, kernel arguments, KV write and call; ``ops.py``: where their functions
come from). A backend class per provider (its ``kernels``) declares what that provider's
kernels can do, because the conformance suite and selection read ``capabilities`` from the
class. The plugin registers the class of the chosen provider under the name ``flash``
(``ATTNHUB_FLASH_PROVIDER`` picks it); ``backend_class(provider)`` gives any of them for direct
use or ``attnhub.register_backend(..., replace=True)``. Nothing here names a provider.

Per step, the builder does every host-side thing once: int32 lengths and block table, the
decode-only decision, the provider's own per-call arguments (FA2's cumulative KV lengths,
FA3's schedule on vLLM's fork), the KV write's plan. Per layer, the impl makes one KV write and
**one** attention call for the whole batch (a cascade: two, merged by LSE), with no loop over
requests and no host read of a device tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Step,
)
from attnhub.batch import BatchMetadata
from attnhub.capabilities import Capabilities, Refusal
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kit import as_contiguous, merge_attn_states, quantize_fp8
from attnhub.kv_cache import PagedKVCache
from attnhub.mla import MLASpec
from attnhub.spec import AttentionSpec
from attnhub_flash import ops, providers
from attnhub_flash.providers import FP8_KV, KernelArgs, Provider

CascadePolicy = Literal["auto", "always", "never"]


@dataclass(frozen=True)
class FlashAttentionMetadata(AttentionMetadata):
    """One step, planned: every argument of the kernels, ready to pass."""

    provider: str = providers.DEFAULT
    num_actual_tokens: int = 0
    main: KernelArgs | None = None  # the one call of a step (None: no tokens)
    #: Cascade: the shared prefix as one non-causal call of every query token over the
    #: prefix blocks, then ``suffix`` (each request over its own blocks), merged by LSE.
    prefix: KernelArgs | None = None
    suffix: KernelArgs | None = None
    slot_mapping: torch.Tensor | None = None  # [num_tokens] int64, device (vLLM's write)
    write_rows: torch.Tensor | None = None  # [m] int64: tokens that have a slot (scatter)
    write_slots: torch.Tensor | None = None  # [m] int64: their slots
    #: Planned for a captured graph (``build_for_graph_capture``): ``main`` holds the graph's
    #: bounds and persistent tensors; the KV write is the fixed-shape one over ``slot_mapping``.
    graph: bool = False

    @property
    def cascade(self) -> bool:
        return self.prefix is not None


def use_cascade(
    common_prefix_len: int,
    query_lens: torch.Tensor,  # [B] int, host
    num_heads: int,
    num_kv_heads: int,
    *,
    use_alibi: bool,
    use_sliding_window: bool,
    num_sms: int,
) -> bool:
    """vLLM's heuristic (``vllm/v1/attention/backends/flash_attn.py: use_cascade_attention``):
    is a shared prefix worth a separate call? A rough CTA-count model of FlashDecoding against
    the cascade's prefix pass [callers]."""
    if common_prefix_len < 256 or use_alibi or use_sliding_window:
        return False
    num_reqs = int(query_lens.numel())
    if num_reqs < 8:
        return False
    group = num_heads // num_kv_heads
    flash_decoding = group > 1 and bool((query_lens == 1).all())
    if not flash_decoding:
        return True
    tile = 128
    prefix_tiles = -(-common_prefix_len // tile)
    cascade_ctas = num_heads * -(-num_reqs // tile)
    cascade_time = -(-cascade_ctas // num_sms) * prefix_tiles
    decoding_ctas = num_reqs * num_kv_heads * -(-group // tile) * prefix_tiles
    return cascade_time < -(-decoding_ctas // num_sms)


class FlashMetadataBuilder(AttentionMetadataBuilder[FlashAttentionMetadata]):
    """Plans a step once for every layer."""

    backend: FlashBackend
    metadata_type = FlashAttentionMetadata

    def __init__(self, backend: FlashBackend) -> None:
        super().__init__(backend)
        #: When a shared prefix runs as a cascade: "auto" (vLLM's heuristic, ``use_cascade``),
        #: "always" (whenever it is whole blocks and the spec allows) or "never". The
        #: heuristic models GPU kernels; emulated, "always", so that the cascade path is the
        #: one the suite checks.
        self.cascade_policy: CascadePolicy = "always" if backend.emulated else "auto"
        #: The GPU's SM count, for the heuristic (read once per builder, not per step).
        self._num_sms = (
            0
            if backend.emulated
            else torch.cuda.get_device_properties(backend.device).multi_processor_count
        )

    def plan(self, step: Step) -> Mapping[str, Any]:
        backend, batch = self.backend, step.batch
        kernels = backend.kernels
        n = batch.num_actual_tokens
        fields: dict[str, Any] = dict(provider=backend.provider, num_actual_tokens=n)
        if n:
            causal = self.spec.causal and batch.causal
            main = self._kernel_args(
                # int32 and contiguous once per step, not per layer
                as_contiguous(batch.query_start_loc),
                batch.max_query_len,
                as_contiguous(batch.seq_lens),
                batch.seq_lens_cpu,
                batch.max_seq_len,  # checked against the lengths by build's checks
                as_contiguous(batch.block_table),
                causal,
                # every query one token: no query is longer than 1 and they are as many as
                # the requests
                decode_only=n == batch.num_reqs and batch.max_query_len == 1,
            )
            fields["main"] = main
            blocks = step.common_prefix_len // batch.block_size  # whole shared blocks
            if blocks and causal and self._wants_cascade(batch, blocks * batch.block_size):
                fields.update(self._cascade(batch, main, blocks))
        # the KV write's plan: the provider's fields
        fields.update(kernels.plan_write(batch, backend.device, backend.spec))
        return fields

    def build_for_graph_capture(self, batch: BatchMetadata) -> FlashAttentionMetadata:
        """A captured step's metadata (docs/graphs.md): one call over the runner's persistent
        buffers (no cascade), whose host ints are the graph's bounds, not this step's values:
        ``max_seqlen_q`` the descriptor's query length (a uniform batch) or its token count
        (a mixed one, ALWAYS), ``max_seqlen_k`` the block table's capacity (vLLM captures with
        the max model length: a replay with a longer sequence than the capture step's is
        covered); FA3's ``num_splits`` fixed. The KV write reads the persistent slot mapping
        on the device. Host values a provider must refresh per step: ``update_graph_params``."""
        step = self.capture_step(batch)
        batch = step.batch
        kernels = self.backend.kernels
        n = batch.num_actual_tokens
        fields: dict[str, Any] = dict(provider=self.backend.provider, num_actual_tokens=n)
        fields.update(kernels.plan_graph_write(batch), graph=True)
        if n:
            q = batch.query_lens_cpu
            uniform = bool((q == q[0]).all())
            max_q = int(q[0]) if uniform else n
            fields["main"] = self._kernel_args(
                as_contiguous(batch.query_start_loc),
                max_q,
                as_contiguous(batch.seq_lens),
                batch.seq_lens_cpu,
                int(batch.block_table.shape[1]) * batch.block_size,
                as_contiguous(batch.block_table),
                self.spec.causal and batch.causal,
                decode_only=uniform and max_q == 1,
                graph=True,
            )
        return self.metadata(step, fields)

    def _kernel_args(self, *args: Any, **kwargs: Any) -> KernelArgs:
        """The provider's arguments of one call (``Provider.kernel_args``), with the keyword
        arguments every layer passes alike made now, once per step (``step_kwargs``)."""
        kernels = self.backend.kernels
        a = kernels.kernel_args(self.backend, *args, **kwargs)
        a.step_kwargs.update(kernels.step_kwargs(self.spec, a))
        return a

    def _wants_cascade(self, batch: BatchMetadata, prefix_len: int) -> bool:
        policy = self.cascade_policy
        if policy not in ("auto", "always", "never"):
            raise InvalidInputError(
                f"cascade_policy = {policy!r} is not one of 'auto', 'always', 'never'"
            )
        if policy == "never":
            return False
        spec = self.spec
        if spec.use_alibi or spec.has_window:  # as vLLM: a cascade would break both
            return False
        if policy == "always":
            return True
        return use_cascade(
            prefix_len,
            batch.query_lens_cpu,
            spec.num_heads,
            spec.num_kv_heads,
            use_alibi=spec.use_alibi,
            use_sliding_window=spec.has_window,
            num_sms=self._num_sms,
        )

    def _cascade(self, batch: BatchMetadata, main: KernelArgs, blocks: int) -> dict[str, Any]:
        """The prefix and suffix calls (vLLM's ``cascade_attention``): every query token over
        the ``blocks`` shared blocks, non-causal (every query sits after the prefix); then each
        request causally over the rest of its blocks."""
        table = batch.host_block_table()
        shared = table[:, :blocks]
        if not bool((shared == shared[:1]).all()):
            r = int((shared != shared[:1]).any(1).nonzero()[0, 0])
            raise InvalidInputError(
                f"common_prefix_len = {batch.block_size * blocks} spans {blocks} blocks, but "
                f"block_table[{r}, :{blocks}] = {table[r, :blocks].tolist()} differs from "
                f"block_table[0, :{blocks}] = {table[0, :blocks].tolist()}"
            )
        dev = self.backend.device
        prefix_len = blocks * batch.block_size
        n = batch.num_actual_tokens
        prefix_lens = torch.tensor([prefix_len], dtype=torch.int32)
        suffix_lens = batch.seq_lens_cpu.to(torch.int32) - prefix_len
        prefix = self._kernel_args(
            torch.tensor([0, n], dtype=torch.int32, device=dev),
            n,
            prefix_lens.to(dev),
            prefix_lens,
            prefix_len,
            main.block_table[:1, :blocks].contiguous(),
            causal=False,
        )
        suffix = self._kernel_args(
            main.query_start_loc,
            main.max_query_len,
            suffix_lens.to(dev),
            suffix_lens,
            main.max_seq_len - prefix_len,
            main.block_table[:, blocks:].contiguous(),
            causal=True,
        )
        return dict(prefix=prefix, suffix=suffix)


class FlashScheduledBuilder(FlashMetadataBuilder):
    """The builder of a provider whose captured call takes a host-planned value
    (``Provider.graph_updates``: vllm-fa3's FA3 schedule), refreshed before every replay."""

    def update_graph_params(
        self, graph_meta: FlashAttentionMetadata, batch: BatchMetadata, stream: Any
    ) -> None:
        """Plan the captured call's host-planned arguments again for this step, from the
        persistent buffers the runner has refilled (on the current stream, before the replay:
        ``stream`` is None on the eager tape and on CUDA, whose adaptor has no update stream)."""
        main = graph_meta.main
        if main is None:
            return
        if stream is None:
            self.backend.kernels.refresh_graph_args(self.backend, main)
            return
        with torch.cuda.stream(stream):
            self.backend.kernels.refresh_graph_args(self.backend, main)


class FlashAttentionImpl(AttentionImpl):
    """One layer: one KV write, then one attention call for the whole batch, both made by the
    backend's provider (``backend.kernels``) with this layer's arguments."""

    backend: FlashBackend

    def __init__(
        self,
        backend: FlashBackend,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(backend, alibi_slopes=alibi_slopes, sinks=sinks)
        spec = self.spec
        kernels = self.kernels = backend.kernels
        self.softcap = spec.logits_soft_cap or 0.0  # 0.0 = off, the kernels' spelling
        self.window = kernels.window(spec)  # as the provider spells it
        # reshape_and_cache_flash takes per-tensor scales even for an unquantized cache
        ones = torch.ones(1, dtype=torch.float32, device=backend.device)
        self.unit_scales = (ones, ones.clone())
        #: fp8 cache (FA3): the query goes in as fp8(q / q_scale) too, with this static
        #: scale (attnhub's ``fp8_static`` scheme, 1.0 as vLLM's default ``_q_scale``)
        self.fp8 = spec.kv_cache_dtype == FP8_KV
        self._q_scale = ones.clone()
        #: the last K/V planes check_planes accepted (a model calls each layer with its own
        #: cache, step after step: checked once, as the core remembers its cache checks)
        self._planes_ok: tuple[torch.Tensor, torch.Tensor] | None = None
        #: fp8: the descales last made (key scale, value scale, batch size, the descales),
        #: reused while the cache's scale tensors and the batch size are the same
        self._descales_made: tuple[Any, Any, int, dict[str, torch.Tensor]] | None = None
        #: The sinks as the provider's kernel takes them, made once per layer.
        self.kernel_sinks = kernels.layer_sinks(self.sinks)

    def check_call(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, FlashAttentionMetadata) or meta.provider != self.backend.provider:
            raise InvalidInputError(
                f"meta must come from this flash backend's metadata_builder().build(batch) "
                f"(provider {self.backend.provider}), got {type(meta).__name__}"
            )
        self.check_planes(cache)

    def check_planes(self, cache: PagedKVCache) -> None:
        """What the provider's kernels need of the K/V planes beyond attnhub's shared cache
        checks (``Provider.check_planes``), checked once per pair of planes. O(1); raises
        InvalidInputError before anything is written."""
        key, value = cache.key, cache.value
        ok = self._planes_ok
        if ok is not None and ok[0] is key and ok[1] is value:
            return
        self.kernels.check_planes(key, value)
        self._planes_ok = (key, value)

    # --- KV write ---------------------------------------------------------------------------
    def store_kv(
        self,
        key: torch.Tensor,  # [>= n, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int32/int64, -1 = padding
        meta: AttentionMetadata | None = None,
    ) -> None:
        if meta is not None:  # a step's write, as the builder planned it
            assert isinstance(meta, FlashAttentionMetadata)
            if meta.num_actual_tokens:
                self.kernels.write_step(self, key, value, cache, meta)
            return
        self.check_planes(cache)  # write_kv without a step: not checked by check_call
        if slot_mapping.shape[0] == 0:
            return
        # the base class has checked these slots on the host already
        self.kernels.write(self, key, value, cache, slot_mapping)

    # --- attention ----------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size]
        lse: torch.Tensor | None = None,  # [num_tokens, num_heads] float32: return_lse=True
    ) -> None:
        assert isinstance(meta, FlashAttentionMetadata)
        n = meta.num_actual_tokens
        if n == 0:
            return
        if query.shape[0] != n:  # padding rows past the step's tokens (out is like query)
            query, out = query[:n], out[:n]
        q = query
        if self.fp8:  # FA3 takes q, k and v in one dtype: fp8(q / q_scale) [source]
            q = quantize_fp8(q, self._q_scale)
        call = self.kernels.call  # (impl, q, cache, args, out, lse, sinks) -> (out, lse)
        want = lse is not None  # the LSE from the same call: each provider's flag
        if meta.prefix is None:
            assert meta.main is not None
            result, kernel_lse = call(self, q, cache, meta.main, out, want, self.kernel_sinks)
            if result is not out:
                out.copy_(result)
            if lse is not None:
                assert kernel_lse is not None
                self.kernels.store_lse(lse[:n], kernel_lse, self.kernel_sinks)
                if self.alibi_slopes is not None:  # FA2's causal branch biases its LSE
                    self.kernels.unbias_alibi_lse(
                        lse[:n], self.alibi_slopes, meta.main, self.window, cache.block_size
                    )
            return
        assert meta.suffix is not None
        # the prefix carries no sink (it joins the denominator once: in the suffix call)
        o1, lse1 = call(self, q, cache, meta.prefix, None, True, None)
        o2, lse2 = call(self, q, cache, meta.suffix, None, True, self.kernel_sinks)
        assert lse1 is not None and lse2 is not None
        merged, merged_lse = merge_attn_states(o1, lse1, o2, lse2)  # the kit's LSE merge
        out.copy_(merged)
        if lse is not None:  # the merge's: +inf where both parts are empty, the sink counted once
            lse[:n].copy_(merged_lse.t())

    def descales(self, cache: PagedKVCache, a: KernelArgs) -> dict[str, torch.Tensor]:
        """fp8 calls: FA3's ``q/k/v_descale``, float32 (batch, num_kv_heads): the per-tensor
        scales expanded (stride 0, as vLLM passes ``layer._k_scale.expand(...)``); none for
        other caches."""
        if not self.fp8:
            return {}
        k_scale, v_scale = cache.key_scale, cache.value_scale
        assert k_scale is not None and v_scale is not None
        batch = a.block_table.shape[0]
        made = self._descales_made
        if made is not None and made[0] is k_scale and made[1] is v_scale and made[2] == batch:
            return made[3]  # views of the same scale tensors: they read any in-place update
        shape = (batch, self.spec.num_kv_heads)
        descales = {
            "q_descale": self._q_scale.reshape(1, 1).expand(shape),
            "k_descale": k_scale.reshape(1, 1).expand(shape),
            "v_descale": v_scale.reshape(1, 1).expand(shape),
        }
        self._descales_made = (k_scale, v_scale, batch, descales)
        return descales


class FlashBackend(AttentionBackend):
    """The FlashAttention backend; a subclass per provider sets ``kernels`` (the provider
    object), from which ``provider`` (its name) and ``capabilities`` follow."""

    name = "flash"
    builder_type = FlashMetadataBuilder
    impl_type = FlashAttentionImpl
    #: The provider: capabilities, refusals, kernel arguments, KV write and attention call.
    kernels: ClassVar[Provider] = providers.VLLM
    provider: ClassVar[str] = providers.VLLM.name
    capabilities = providers.VLLM.capabilities

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.provider = cls.kernels.name
        cls.capabilities = cls.kernels.capabilities
        updates = cls.kernels.graph_updates  # a captured call with a host-planned value
        cls.builder_type = FlashScheduledBuilder if updates else FlashMetadataBuilder

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        return ops.unavailable_reason(cls.kernels, device, emulate)

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        return ops.is_emulated(device)

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        declared = super().unsupported_reasons(spec)
        if isinstance(spec, MLASpec):  # Capabilities.mla says it all, with its reasons
            return declared
        return cls.kernels.refusals(spec, declared)

    @classmethod
    def mla_unsupported_reasons(cls, spec: MLASpec) -> list[Refusal]:
        """The declaration's reasons, then what the provider's kernels refuse on the
        architecture they select (FA4's qv: Blackwell only)."""
        return super().mla_unsupported_reasons(spec) or cls.kernels.mla_refusals(spec)

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        #: The provider's modules (or the emulator's namespaces), resolved once per instance.
        self.ops = ops.resolve(self.kernels, self.device, emulate)
        if not self.ops.emulated:
            # what the spec needs of this very GPU beyond the provider's own range
            # (``unsupported_reasons`` read the current one)
            reasons = self.kernels.device_refusals(self.spec, self.device)
            if reasons:
                raise UnsupportedConfigurationError(self.name, reasons)

    def __repr__(self) -> str:
        mode = ", emulated" if self.emulated else ""
        return f"<{type(self).__name__} 'flash' ({self.provider}) on {self.device}{mode}>"


class FlashVllmBackend(FlashBackend):
    kernels = providers.VLLM


class FlashVllmFA3Backend(FlashBackend):
    kernels = providers.VLLM_FA3


class FlashVllmFlashMLABackend(FlashBackend):
    kernels = providers.VLLM_FLASHMLA


class FlashFA2Backend(FlashBackend):
    kernels = providers.FA2


class FlashFA3Backend(FlashBackend):
    kernels = providers.FA3


class FlashFA4Backend(FlashBackend):
    kernels = providers.FA4


from attnhub_flash.mla import FlashMLAImpl, FlashMLAMetadataBuilder  # noqa: E402 (a cycle)

FlashBackend.mla_builder_type = FlashMLAMetadataBuilder
FlashBackend.mla_impl_type = FlashMLAImpl

BACKENDS: dict[str, type[FlashBackend]] = {
    cls.provider: cls
    for cls in (
        FlashVllmBackend,
        FlashVllmFA3Backend,
        FlashVllmFlashMLABackend,
        FlashFA2Backend,
        FlashFA3Backend,
        FlashFA4Backend,
    )
}
#: What each provider's kernels take, by provider name.
CAPABILITIES: dict[str, Capabilities] = {name: cls.capabilities for name, cls in BACKENDS.items()}


def backend_class(provider: str | None = None) -> type[FlashBackend]:
    """The backend class of ``provider`` (None: ``providers.chosen_provider()``, i.e. the
    ``ATTNHUB_FLASH_PROVIDER`` environment variable, else the best importable one)."""
    name = providers.chosen_provider() if provider is None else provider
    try:
        return BACKENDS[name]
    except KeyError:
        raise InvalidInputError(
            f"{name!r} is not a FlashAttention provider (one of {', '.join(BACKENDS)})"
        ) from None
