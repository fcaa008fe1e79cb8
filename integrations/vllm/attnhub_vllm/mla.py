"""vLLM v1 MLA backend that runs every MLA layer (DeepSeek-V2/V3) through an attnhub backend:
the decode through its MLA impl (the absorbed form), the prefill through its standard impl (the
expanded form) where it serves the layer's expanded geometry.

vLLM 0.32 splits an MLA layer's work between the layer and the backend's impl:

- ``MLAAttention`` (the layer) owns the weights and their absorption: after loading it splits
  ``kv_b_proj`` into ``W_UK_T`` / ``W_UV`` (``process_weights_after_loading``); each step its
  ``forward_impl`` multiplies the decode tokens' ``q_nope`` by ``W_UK`` (the absorbed query
  ``(q_nope @ W_UK, q_pe)``), calls ``impl.forward_mqa`` and multiplies the latent output by
  ``W_UV`` (``_v_up_proj``). Tokens past ``num_decode_tokens`` go to ``impl.forward_mha``.
- the impl (``MLACommonImpl``) supplies ``do_kv_cache_update`` (the latent write),
  ``forward_mqa`` (the absorbed decode) and ``forward_mha`` (the expanded prefill, through the
  prefill backend the layer picked: ``get_mla_prefill_backend``, on CPU an SDPA).

vLLM tier                 -> attnhub
``MLACommonBackend``      -> :class:`AttnhubVllmMLABackend` (registered in place of vLLM's
                             CPU MLA backends by the plugin when attnhub is selected)
builder ``build``         -> vLLM's ``MLACommonMetadataBuilder.build`` (its decode/prefill
                             split and prefill metadata), plus the attnhub builder's
                             ``build`` of the decode requests (``BatchMetadata`` of them)
``do_kv_cache_update``    -> attnhub ``MLAImpl.write_kv`` into ``mapping.latent_cache`` of
                             vLLM's own cache tensor (no copy, no extra bytes): its joint
                             plane, or for a backend reading split planes only (ascend) the
                             kv_c then k_pe planes carved in place, allowed only where the
                             engine config gives no prefill cached context (vLLM's
                             forward_mha reads it in the joint layout): with the
                             step's metadata in a decode-only step (slots checked once per
                             step), else with vLLM's slot mapping (checked per layer)
``forward_mqa``           -> attnhub ``MLAImpl.forward`` (q ``[B, H, kv_lora_rank + rope]``
                             -> latent output ``[B, H, kv_lora_rank]``)
``forward_mha``           -> the same attnhub backend's standard ``AttentionImpl.forward`` for
                             ``AttentionSpec(head_size=qk_nope + rope, head_size_v=v_head_dim,
                             num_kv_heads=num_heads)``, causal: keys ``[k_nope ; k_pe]`` and
                             values from ``kv_b_proj`` (vLLM's own expansion), written into a
                             transient cache made for the call (``attnhub_vllm.mla_prefill``;
                             the step's prefills built once per step by the builder). Where the
                             backend refuses that spec but its MLA impl serves every query
                             length (``cpu`` on ``AMX_MLA``), the absorbed form through it
                             (``q_nope @ W_UK``, the MLA impl over the latent cache, ``@ W_UV``);
                             else (``cpu`` on ``CPU_MLA``; ``ascend`` / ``flash`` for the tiny
                             model's 96 / 32) vLLM's own ``MLACommonBaseImpl.forward_mha``;
                             decided once per layer in ``bind`` and logged with the reason.
                             Cached context (chunked prefill, prefix caching: ``AMX_MLA``'s
                             engines) is read from the latent cache through attnhub
                             (``attnhub.kit.read_latent_rows``), expanded by ``kv_b_proj`` as
                             vLLM expands it and attended with the new tokens in the same call,
                             calls bounded by vLLM's chunked-prefill workspace; context sharded
                             by decode context parallel stays vLLM's (refused by name if it
                             comes to attnhub's route).

fp8 latent caches (vLLM ``kv_cache_dtype`` fp8 / fp8_e4m3 / fp8_e5m2): vLLM's uint8 plane viewed
in the fp8 dtype, the layer's ``_k_scale`` as the latent's scale, the decode query in the model
dtype (``supports_quant_query_input = False``), where the backend declares the format.

Decode context parallel: ``can_return_lse_for_decode`` from ``Capabilities.mla.lse``; the
builder plans the decode requests with the adapter's DCP planner (``attnhub_vllm.dcp``); vLLM's
layer gathers the query over the DCP group's heads and merges by the LSEs itself
(``MLADCPManager``), so ``forward_mqa`` returns the rank's partial over its shard and its LSE.

Unsupported configurations fail at engine start (impl construction) with attnhub's reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionLayer, CommonAttentionMetadata

from attnhub.kit import same_view
from attnhub.mla import LatentKVCache, MLASpec
from attnhub_vllm import dcp as dcp_
from attnhub_vllm import mla_prefill
from attnhub_vllm.backend import backend_for, configured_checks, configured_choice
from attnhub_vllm.mapping import (
    MLA_KV_CACHE_DTYPES,
    AttnhubConfigurationError,
    decode_batch,
    extra_kv_bytes,
    latent_cache,
    mla_layout_refusal,
    mla_spec_from_vllm,
    page_moving_sources,
    prefill_context_sources,
    refuse_split_prefill_context,
)

logger = init_logger("vllm.attnhub_vllm")


class AttnhubVllmMLABackend(MLACommonBackend):
    """vLLM's view of attnhub for MLA layers: one class for every attnhub backend."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(MLA_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        # The AttentionBackendEnum member the plugin registers this class in place of (vLLM's
        # CPU platform picks CPU_MLA for MLA models without AMX).
        return "CPU_MLA"

    @staticmethod
    def get_impl_cls() -> type[AttnhubVllmMLAImpl]:
        return AttnhubVllmMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AttnhubVllmMLAMetadataBuilder]:
        return AttnhubVllmMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent size: the chosen attnhub backend refuses at start with reasons


@dataclass
class AttnhubVllmMLAMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    """vLLM's MLA metadata of a step, plus per attnhub builder the attnhub metadata of its
    decode requests (None when the step has none)."""

    attnhub: list[Any] = field(default_factory=list)
    #: per attnhub builder, the step's prefills in the expanded form's transient cache
    #: (``mla_prefill.PrefillStep``; None where the layers' prefill is vLLM's own)
    attnhub_prefill: list[Any] = field(default_factory=list)


class AttnhubVllmMLAMetadataBuilder(MLACommonMetadataBuilder[AttnhubVllmMLAMetadata]):
    """vLLM's MLA builder (decode/prefill split, prefill metadata for ``forward_mha``) and, once
    per step for all layers, the attnhub builder's metadata of the decode requests."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
        metadata_cls: type[AttnhubVllmMLAMetadata] | None = None,
        supports_dcp_with_varlen: bool = False,
    ) -> None:
        super().__init__(
            kv_cache_spec,
            layer_names,
            vllm_config,
            device,
            metadata_cls or AttnhubVllmMLAMetadata,
            supports_dcp_with_varlen,
        )
        self.block_size = int(kv_cache_spec.block_size)
        ctx = vllm_config.compilation_config.static_forward_context
        builders: dict[MLASpec, Any] = {}
        backends: dict[MLASpec, Any] = {}
        prefill_builders: dict[MLASpec, Any] = {}
        split: list[str] = []  # layers whose latents are split planes carved in vLLM's memory
        checks = configured_checks(vllm_config)  # additional_config["attnhub"]["checks"]
        for name in layer_names:
            impl = ctx[name].impl
            if not isinstance(impl, AttnhubVllmMLAImpl):
                raise AttnhubConfigurationError(
                    f"attnhub-vllm: MLA layer {name} has impl {type(impl).__name__}, not "
                    "attnhub's: every layer of one MLA builder must run through attnhub"
                )
            impl.layer_name = name  # where its step metadata is in vLLM's forward context
            spec = impl.bind(self.block_size, device)
            if spec not in builders:
                backends[spec] = backend_for(spec, device, impl.choice)
                builders[spec] = backends[spec].metadata_builder()
                builders[spec].checks = checks
                route = impl.prefill_route
                prefill_builders[spec] = None
                if route is not None and route.attnhub:
                    # the expanded spec's builder, or (absorbed) a second MLA builder of its own
                    prefill_builders[spec] = (route.backend or route.absorbed).metadata_builder()
                    prefill_builders[spec].checks = checks
            impl.meta_index = list(builders).index(spec)
            route = impl.prefill_route
            if impl.layout != "joint" and not (route is not None and route.attnhub):
                split.append(name)  # split planes vLLM's own forward_mha would read
        self._split_layers = split
        self._attnhub_builders = list(builders.values())
        self._prefill_builders = list(prefill_builders.values())
        self._device = device
        # decode context parallel: the adapter's DCP planner (attnhub_vllm.dcp, shared with
        # standard layers) over vLLM's DCP group, one DecodeContextParallel per MLA spec
        self._dcp = (
            dcp_.DcpPlanner(list(backends.values()), vllm_config, device)
            if dcp_.dcp_size(vllm_config) > 1
            else None
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnhubVllmMLAMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        # the config ruled this out (mla_layout_refusal): refuse rather than let vLLM's
        # forward_mha read split planes as its joint plane, should it come anyway
        refuse_split_prefill_context(self._split_layers, md.prefill)
        if md.num_decodes and self._dcp is not None:  # every rank: the decodes' shard plan
            decodes = (md.num_decodes, md.num_decode_tokens)
            _, md.attnhub = self._dcp.plan(common_attn_metadata, False, decodes)
        elif md.num_decodes:
            batch = decode_batch(
                common_attn_metadata, self.block_size, md.num_decodes, md.num_decode_tokens
            )
            md.attnhub = [b.build(batch) for b in self._attnhub_builders]
        prefill = md.prefill
        chunked = None if prefill is None else prefill.chunked_context
        if prefill is not None and (chunked is None or self.dcp_world_size == 1):
            # the step's prefills in the expanded form's transient caches (each request's
            # cached context before its new tokens), once for all layers (context sharded over
            # DCP ranks: none; forward_mha refuses, naming the request)
            assert prefill.query_lens_cpu is not None
            context: dict[str, Any] = {}
            if chunked is not None:
                context = dict(
                    context_lens=chunked.context_lens_list,
                    block_table=prefill.block_table,
                    latent_block_size=self.block_size,
                    max_context_rows=self.chunked_prefill_workspace_size,
                )
            md.attnhub_prefill = [
                self._prefill_step(b, prefill, context) for b in self._prefill_builders
            ]
        return md

    def _prefill_step(self, builder: Any, prefill: Any, context: dict[str, Any]) -> Any:
        """One attnhub prefill builder's metadata of the step's prefills: the expanded form's
        calls (``mla_prefill.build_prefill_step``), or the MLA builder's build of the prefills
        over the latent cache (the absorbed form)."""
        if builder is None:
            return None
        if builder.backend.is_mla:
            batch = mla_prefill.absorbed_batch(
                prefill.query_lens_cpu,
                context.get("context_lens"),
                prefill.block_table,
                self.block_size,
                self._device,
            )
            return builder.build(batch)
        return mla_prefill.build_prefill_step(
            builder, prefill.query_lens_cpu, self._device, **context
        )


class AttnhubVllmMLAImpl(MLACommonImpl[AttnhubVllmMLAMetadata]):
    """``MLACommonImpl`` with its decode, its latent write and (where the backend serves the
    expanded geometry: ``prefill_route``) its prefill through attnhub."""

    #: vLLM asks an impl for the decode's LSE only under decode context parallel; set per
    #: layer from the backend's ``Capabilities.mla.lse`` (``_declare_lse``).
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        # MLA arguments (forwarded by vLLM's MLAAttention)
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        qk_head_dim: int,
        v_head_dim: int,
        kv_b_proj: Any,
        indexer: object | None = None,
        q_pad_num_heads: int | None = None,
    ) -> None:
        # vLLM's MLACommonImpl.__init__: the MLA dimensions, kv_b_proj (forward_mha's
        # expansion), dcp_world_size; it picks no kernel (the layer picks the prefill backend).
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            qk_head_dim,
            v_head_dim,
            kv_b_proj,
            indexer,
            q_pad_num_heads,
        )
        if indexer is not None:
            raise AttnhubConfigurationError(
                "attnhub-vllm: sparse MLA (an indexer, DeepSeek-V3.2) is not mapped"
            )
        self.alibi_slopes = alibi_slopes
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attn_type = attn_type
        config = get_current_vllm_config()
        self.dtype = config.model_config.dtype
        self.choice = configured_choice(config)
        self.spec: MLASpec | None = None
        self.meta_index = 0  # set by the metadata builder
        self.layer_name: str | None = None  # set by the metadata builder
        self._impl: Any = None
        self._cache_key: tuple[int, torch.Size] | None = None
        self._cache: LatentKVCache | None = None
        # the latent layout in vLLM's memory ("joint": vLLM's plane; "split": the backend's two
        # planes carved in place, allowed only where this engine's config gives no prefill a
        # cached context, which vLLM's forward_mha would read in the joint layout)
        self.layout = "joint"
        self._prefill_context = prefill_context_sources(config)
        self._page_movers = page_moving_sources(config)
        #: who serves this layer's prefill (``forward_mha``), decided once in ``bind``
        self.prefill_route: mla_prefill.PrefillRoute | None = None
        #: the absorbed prefill's W_UK / W_UV (``_absorption``), made on first use
        self._w_uk_uv: tuple[torch.Tensor, torch.Tensor] | None = None
        # vLLM quantizes the prefill's query, keys and values to fp8 where asked (its
        # determine_prefill_query_data_type): not mapped, that prefill stays vLLM's own
        self._fp8_prefill = bool(
            kv_cache_dtype.startswith("fp8")
            and getattr(config.attention_config, "use_prefill_query_quantization", False)
        )
        # prefills with cached context come where the config has a source of it (chunked
        # prefill, prefix caching, ...: vLLM's CPU platform turns the first two off for MLA
        # models, except with AMX_MLA): attnhub's prefill reads that context from this rank's
        # latent cache, so under decode context parallel (the context sharded over ranks) the
        # prefill stays vLLM's own
        self._sharded_context = self.dcp_world_size > 1 and bool(self._prefill_context)
        # vLLM's MLAAttention quantizes the decode query to fp8 for an fp8 cache where the impl
        # takes one (MLACommonImpl: True); attnhub's MLA forward takes the model-dtype query
        # over an fp8 latent (dequantized as vLLM's kernels read it), as vLLM's CPU_MLA does
        self.supports_quant_query_input = False
        block_size = config.cache_config.block_size
        if block_size:  # refuse at model construction where the block size is known
            self.bind(int(block_size), "cpu" if config.device_config is None else None)
            self._declare_lse(config)

    def _declare_lse(self, config: VllmConfig) -> None:
        """vLLM's ``can_return_lse_for_decode`` from the attnhub backend's ``Capabilities.mla.lse``
        for this layer, and ``need_to_return_lse_for_decode`` as vLLM's base computes it (its
        ``__new__`` read the class default); under decode context parallel, refuse at engine
        start with attnhub's reasons where the backend cannot serve it (before vLLM's own
        ``check_attention_cp_compatibility``, which names only a missing LSE)."""
        assert self.spec is not None
        device = config.device_config.device if config.device_config is not None else None
        backend = backend_for(self.spec, device or "cpu", self.choice)
        self.can_return_lse_for_decode = backend.capabilities.mla.lse.refusal(self.spec) is None
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode
        )
        if self.dcp_world_size > 1:
            dcp_.refuse_unserved(backend, self.spec, self.dcp_world_size)

    def _spec(self, block_size: int) -> MLASpec:
        spec, reasons = mla_spec_from_vllm(
            num_heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            dtype=self.dtype,
            block_size=block_size,
            scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype,
            attn_type=self.attn_type,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            use_alibi=self.alibi_slopes is not None,
        )
        if spec is None:
            raise AttnhubConfigurationError(
                "attnhub-vllm cannot map this MLA layer: " + "; ".join(reasons)
            )
        return spec

    def bind(self, block_size: int, device: torch.device | str | None) -> MLASpec:
        """Fix this layer's spec (and check that the attnhub backend serves it: a backend that
        declares no MLA is refused here, with its reasons)."""
        spec = self._spec(block_size)
        if device is None:
            device = get_current_vllm_config().device_config.device
        backend = backend_for(spec, device or "cpu", self.choice)  # raises with its reasons
        layouts = tuple(backend.capabilities.mla.layouts)
        layout = "joint" if "joint" in layouts else "split"
        if spec != self.spec or layout != self.layout:
            route = mla_prefill.prefill_route(
                backend,
                spec,
                device or "cpu",
                self.choice[1],
                prefill_query_quantization=self._fp8_prefill,
                sharded_context=self._sharded_context,
                context_parallel=self.dcp_world_size > 1,
            )
            # vLLM reads the latent memory as its joint plane in its own forward_mha's context
            # gather (ruled out where attnhub serves the prefill: it reads the context through
            # attnhub's view) and where it moves pages by block id (whoever serves the prefill)
            context = self._page_movers if route.attnhub else self._prefill_context
            refusal = mla_layout_refusal(backend.name, layouts, context)
            if refusal is not None:
                raise AttnhubConfigurationError(refusal)
            self.spec, self.layout, self._impl, self._cache_key = spec, layout, None, None
            self.prefill_route = route
            logger.info_once(
                "attnhub-vllm: backend %r MLA prefill (forward_mha): %s",
                backend.name,
                self.prefill_route.why,
            )
        return spec

    # --- per layer, per step -------------------------------------------------------------
    def _attnhub(self, device: torch.device) -> Any:
        assert self.spec is not None, "the metadata builder binds every layer at start"
        self._impl = backend_for(self.spec, device, self.choice).impl()
        return self._impl

    def _latent(self, kv_cache: torch.Tensor, impl: Any, k_scale: torch.Tensor) -> LatentKVCache:
        """attnhub's view of vLLM's joint latent plane (made once per layer and cache; an fp8
        cache with the layer's ``_k_scale``, the tensor itself: a scale vLLM loads later is
        the one read)."""
        key = (kv_cache.data_ptr(), kv_cache.shape)
        if key != self._cache_key:
            assert self.spec is not None
            self._cache = latent_cache(kv_cache, self.spec, k_scale, self.layout)
            self._cache_key = key
            logger.info_once(
                "attnhub-vllm: backend %r MLA KV cache per layer: %d bytes in vLLM's tensor, "
                "%d bytes extra (latent layout %r)",
                impl.backend.name,
                kv_cache.numel() * kv_cache.element_size(),
                extra_kv_bytes(self._cache, kv_cache),
                self.layout,
            )
        assert self._cache is not None
        return self._cache

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,  # [num_tokens, kv_lora_rank]
        k_pe: torch.Tensor,  # [num_tokens, 1, qk_rope_head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        slot_mapping: torch.Tensor,  # [n <= num_tokens], -1 = padding
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,  # vLLM 0.33+: store fp8 latents without dividing by k_scale
    ) -> None:
        if kv_cache.numel() == 0:  # vLLM's profiling run: no cache bound yet
            return
        if skip_scale and self.kv_cache_dtype.startswith("fp8"):
            raise AttnhubConfigurationError(
                "attnhub-vllm: an fp8 latent written without its scale (skip_scale, vLLM 0.33+) "
                "is not mapped: attnhub's fp8 latents are stored fp8(x / k_scale)"
            )
        impl = self._impl or self._attnhub(kv_c_normed.device)
        cache = self._latent(kv_cache, impl, k_scale)
        k_pe = k_pe.reshape(k_pe.shape[0], -1)
        meta = self._decode_step_meta(slot_mapping)
        if isinstance(meta, dcp_.DcpLayerStep):  # DCP, decodes only: the shard's planned write
            meta.write(kv_c_normed, k_pe, cache)
            return
        if meta is not None:  # a decode-only step: its slots were checked once, in build
            impl.write_kv(kv_c_normed, k_pe, cache, meta=meta)
            return
        # a step with prefills: its write covers tokens the decode metadata does not, so the
        # slots are checked here, on the host (on the CPU platform a host tensor: no sync)
        n = slot_mapping.shape[0]
        impl.write_kv(kv_c_normed[:n], k_pe[:n], cache, slot_mapping)

    def _decode_step_meta(self, slot_mapping: torch.Tensor) -> Any:
        """This step's attnhub metadata when the step is decodes only (it then covers every
        token) and ``slot_mapping`` is the step's own; else None."""
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(self.layer_name)
        if not isinstance(md, AttnhubVllmMLAMetadata) or md.num_prefills or not md.attnhub:
            return None
        meta = md.attnhub[self.meta_index]
        slots = meta.slots if isinstance(meta, dcp_.DcpLayerStep) else meta.batch.slot_mapping
        return meta if same_view(slot_mapping, slots) else None

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: AttnhubVllmMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decode tokens' absorbed attention: ``q`` = (``q_nope @ W_UK`` [B, H,
        kv_lora_rank], ``q_pe`` [B, H, rope]) from vLLM's layer -> the latent output [B, H,
        kv_lora_rank], which the layer multiplies by ``W_UV``."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        elif q.stride(-1) != 1:
            q = q.contiguous()
        impl = self._impl or self._attnhub(q.device)
        meta = attn_metadata.attnhub[self.meta_index]
        cache = self._latent(kv_c_and_k_pe_cache, impl, layer._k_scale)
        if isinstance(meta, dcp_.DcpLayerStep):
            # decode context parallel: vLLM's layer gathered the query over its DCP group's
            # heads (MLADCPManager.query_gather) and merges what this returns by the LSEs
            # (its combine: cp_lse_ag_out_rs or the all-to-all) before W_UV: the partial over
            # this rank's shard for the group's heads, and its LSE
            return meta.partial(q, cache)
        out = impl.forward(q, None, None, cache, meta)
        return out, None

    # --- the prefill ---------------------------------------------------------------------
    def fused_output_quant_supported(self, quant_key: Any) -> bool:
        """vLLM's fused fp8 / fp4 output of the prefill: only where the prefill is vLLM's own
        (attnhub's expanded prefill writes the model dtype)."""
        route = self.prefill_route
        if route is not None and route.attnhub:
            return False
        return bool(super().fused_output_quant_supported(quant_key))

    def forward_mha(
        self,
        q: torch.Tensor,  # [num_prefill_tokens, H, qk_nope + rope]
        kv_c_normed: torch.Tensor,  # [num_prefill_tokens, kv_lora_rank]
        k_pe: torch.Tensor,  # [num_prefill_tokens, 1, rope]
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: AttnhubVllmMLAMetadata,
        k_scale: torch.Tensor,
        output: torch.Tensor,  # [num_prefill_tokens, H * v_head_dim]
        output_scale: torch.Tensor | None = None,
    ) -> None:
        """The prefill tokens' expanded attention: keys ``[k_nope ; k_pe]`` and values from
        ``kv_b_proj`` (the tensors vLLM's own ``forward_mha`` makes), through the attnhub
        backend's standard impl where ``bind`` routed it there (``mla_prefill``), else
        vLLM's own ``forward_mha``."""
        route = self.prefill_route
        if route is None or not route.attnhub:
            super().forward_mha(
                q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                output_scale,
            )  # fmt: skip
            return
        prefill = attn_metadata.prefill
        assert prefill is not None
        name = (route.backend or route.absorbed).name
        mla_prefill.context_refusal(prefill, attn_metadata.num_decodes, name, self.dcp_world_size)
        if output_scale is not None:  # fused_output_quant_supported said no
            raise AttnhubConfigurationError(
                "attnhub-vllm: a fused quantized output of the MLA prefill is not mapped"
            )
        step = attn_metadata.attnhub_prefill[self.meta_index]
        out = output.view(-1, self.num_heads, self.v_head_dim)
        if route.absorbed is not None:  # the MLA impl over the latent cache (already written)
            impl = self._impl or self._attnhub(q.device)
            cache = self._latent(kv_c_and_k_pe_cache, impl, k_scale)
            w_uk, w_uv = self._absorption()
            mla_prefill.forward_absorbed(impl, q, cache, step, w_uk, w_uv, out)
            if prefill.chunked_context is not None:
                logger.info_once(
                    "attnhub-vllm: backend %r MLA prefill with cached context served by "
                    "attnhub: the absorbed form over the latent cache (layout %r)",
                    name,
                    cache.layout,
                )
            return
        k, v = self._expand(kv_c_normed, k_pe)
        latent: LatentKVCache | None = None
        if prefill.chunked_context is not None:  # the context's latents, read through attnhub
            impl = self._impl or self._attnhub(q.device)
            latent = self._latent(kv_c_and_k_pe_cache, impl, k_scale)
            logger.info_once(
                "attnhub-vllm: backend %r MLA prefill with cached context served by attnhub: "
                "the context's latents read from the latent cache (layout %r), expanded by "
                "kv_b_proj",
                route.backend.name,
                latent.layout,
            )
        mla_prefill.forward_expanded(route, q, k, v, step, out, latent, self._expand)

    def _absorption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` [kv_lora_rank, H, qk_nope] and ``W_UV`` [kv_lora_rank, H, v_head_dim] in
        the model dtype, from ``kv_b_proj``'s loaded weight (vLLM's split, as ``AMXMLAImpl``
        makes it in ``process_weights_after_loading``), made on first use."""
        if self._w_uk_uv is None:
            from vllm.model_executor.layers.quantization.utils.quant_utils import (
                get_and_maybe_dequant_weights,
            )

            assert self.spec is not None
            w = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=self.spec.dtype).T
            w = w.reshape(
                self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
            )
            w_uk, w_uv = w.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            self._w_uk_uv = (w_uk.contiguous(), w_uv.contiguous())
        return self._w_uk_uv

    def _expand(
        self,
        kv_c: torch.Tensor,  # [n, kv_lora_rank]
        k_pe: torch.Tensor,  # [n, 1, rope] or [n, rope]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # k [n, H, qk_nope + rope], v [n, H, v_head_dim]
        """vLLM's own expansion (``MLACommonBaseImpl.forward_mha`` for the new tokens,
        ``_compute_prefill_context`` for the context): ``kv_b_proj``, split per head, the
        rope part shared by every head."""
        kv_nope = self.kv_b_proj(kv_c)[0].view(
            -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv_nope.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if k_pe.dim() == 2:
            k_pe = k_pe.unsqueeze(1)
        return self._concat_k_nope_k_pe(k_nope, k_pe), v
