"""vLLM v1 attention backend that runs every attention layer through an attnhub backend.

vLLM tier            -> attnhub call
backend class        -> the attnhub backend chosen by vLLM's config
                        (``additional_config={"attnhub": {"backend": ..., "emulate": ...}}``),
                        else ``ATTNHUB_BACKEND`` (``select_backend``)
builder.build()      -> ``BatchMetadata`` from ``CommonAttentionMetadata`` + ``builder.build``
builder.get_cudagraph_support -> the attnhub builders' ``graph_support`` (same names, same order)
builder.build_for_cudagraph_capture -> ``build_for_graph_capture`` over persistent buffers
                        (a FULL graph's later steps: those buffers refilled, then
                        ``update_graph_params``; docs/graphs.md, "The engine's view")
impl.do_kv_cache_update -> ``impl.write_kv(..., meta=)`` (the step's planned write)
impl.forward         -> ``impl.forward(query, None, None, cache, meta, output=...)``

Unsupported configurations fail at engine start (impl construction and builder construction,
both before the first step) with attnhub's reasons.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.config import (
    VllmConfig,
    get_current_vllm_config,
    get_current_vllm_config_or_none,
    get_layers_from_vllm_config,
)
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

import attnhub
from attnhub import AttentionSpec, BatchMetadata, PagedKVCache
from attnhub.capabilities import GraphSupport
from attnhub.errors import AttnhubError
from attnhub.graphs import BatchDescriptor as GraphDescriptor
from attnhub.kit import (
    GraphAdaptor,
    PersistentBatch,
    StepExtents,
    check_extents,
    pad_batch,
    same_view,
    uniform_query_len,
)
from attnhub.mla import MLASpec
from attnhub_vllm import dcp as dcp_
from attnhub_vllm.mapping import (
    KV_CACHE_DTYPES,
    AttnhubConfigurationError,
    batch_from_common,
    cache_pages,
    cache_planes,
    cache_views,
    checks_from_additional_config,
    choice_from_additional_config,
    extra_kv_bytes,
    real_requests,
    spec_from_vllm,
)

# Under the "vllm" logger so that vLLM's logging configuration shows these lines.
logger = init_logger("vllm.attnhub_vllm")

ENV_BACKEND = "ATTNHUB_BACKEND"


# --- one attnhub backend per (spec, device, choice), shared by every layer and the builder --
#: (backend name, emulate) chosen in vLLM's config; (None, False): the environment decides.
Choice = tuple[str | None, bool]
_BACKENDS: dict[tuple[AttentionSpec | MLASpec, str, Choice], attnhub.AttentionBackend] = {}


def configured_choice(config: VllmConfig | None) -> Choice:
    """The attnhub backend a vLLM config asks for: ``additional_config={"attnhub":
    {"backend": NAME, "emulate": BOOL}}`` (it wins over ``ATTNHUB_BACKEND``)."""
    if config is None:
        return None, False
    try:
        return choice_from_additional_config(config.additional_config)
    except AttnhubConfigurationError as exc:
        raise AttnhubConfigurationError(f"attnhub-vllm: {exc}") from None


def configured_checks(config: VllmConfig | None) -> str:
    """What the builders check of each step: ``additional_config={"attnhub": {"checks":
    "structural"}}`` for shapes, dtypes and devices only; "full" (every value too) by
    default."""
    if config is None:
        return "full"
    try:
        return checks_from_additional_config(config.additional_config)
    except AttnhubConfigurationError as exc:
        raise AttnhubConfigurationError(f"attnhub-vllm: {exc}") from None


def backend_for(
    spec: AttentionSpec | MLASpec, device: torch.device | str, choice: Choice = (None, False)
) -> attnhub.AttentionBackend:
    """The attnhub backend for ``spec`` (a standard layer's, or an MLA layer's): the one
    ``choice`` (vLLM's config) names, else ``ATTNHUB_BACKEND``, else the best available.

    Raises AttnhubConfigurationError with the backend's reasons."""
    key = (spec, str(device), choice)
    backend = _BACKENDS.get(key)
    if backend is None:
        name, emulate = choice
        try:
            backend = attnhub.select_backend(spec, device, prefer=name, emulate=emulate)
        except AttnhubError as exc:
            raise AttnhubConfigurationError(
                f"attnhub backend {name or os.environ.get(ENV_BACKEND) or '(auto)'} cannot serve "
                f"this vLLM {describe_spec(spec)}: {exc}"
            ) from exc
        logger.info_once("attnhub-vllm: attention through attnhub backend %r", backend.name)
        _BACKENDS[key] = backend
    return backend


def describe_spec(spec: AttentionSpec | MLASpec) -> str:
    if isinstance(spec, MLASpec):
        return (
            f"MLA layer (heads {spec.num_heads}, kv_lora_rank {spec.kv_lora_rank}, "
            f"qk_rope_head_dim {spec.qk_rope_head_dim}, dtype "
            f"{str(spec.dtype).removeprefix('torch.')}, block_size {spec.block_size}, "
            f"kv_cache_dtype {spec.kv_cache_dtype})"
        )
    return "attention layer (" + (
        f"heads {spec.num_heads}/{spec.num_kv_heads}, head_size {spec.head_size}, "
        f"dtype {str(spec.dtype).removeprefix('torch.')}, block_size {spec.block_size}, "
        f"kv_cache_dtype {spec.kv_cache_dtype}, sliding_window {spec.sliding_window})"
    )


def paged_cache(
    kv_cache: torch.Tensor,
    backend: attnhub.AttentionBackend,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PagedKVCache:
    """attnhub's cache over vLLM's per-layer tensor for ``backend``: the backend's own block
    layout inside each page where it has one (``kv_cache_from_pages``: its kernels work in
    place), else strided K|V views where the backend declares it takes them
    (``capabilities.strided_kv_cache``), else contiguous K and V planes carved from the same
    memory, else (a non-contiguous tensor) caches of the backend's own. ``scales``: the
    layer's fp8 (k_scale, v_scale), shared, not copied (vLLM may update them in place). Logs
    once per backend the KV bytes a layer uses beyond vLLM's."""
    spec, layout = backend.spec, backend.capabilities.kv_cache_layout
    pages = cache_pages(kv_cache, spec)
    native = None if pages is None else backend.kv_cache_from_pages(pages)
    if native is not None:
        logger.info_once(
            "attnhub-vllm: backend %r lays each block of vLLM's KV-cache tensor out in its "
            "kernels' own layout (pages keep their block ids)",
            backend.name,
        )
        cache = native
        if scales is not None and spec.kv_cache_format.is_quantized:
            cache = dataclasses.replace(cache, key_scale=scales[0], value_scale=scales[1])
    elif backend.capabilities.strided_kv_cache:
        cache = cache_views(kv_cache, spec, layout, scales)
    else:
        planes = cache_planes(kv_cache, spec, layout, scales)
        if planes is not None:
            logger.info_once(
                "attnhub-vllm: backend %r needs contiguous K/V planes: each layer's KV-cache "
                "tensor holds all keys, then all values (KV-transfer connectors that move pages "
                "by block id cannot run beside it)",
                backend.name,
            )
            cache = planes
        else:
            logger.warning_once(
                "attnhub-vllm: backend %r needs contiguous K/V planes and vLLM's KV-cache tensor "
                "is not one dense run of memory: it gets caches of its own (KV memory doubled)",
                backend.name,
            )
            cache = backend.allocate_kv_cache(int(kv_cache.shape[0]))
            if scales is not None and cache.key_scale is not None:
                cache = dataclasses.replace(cache, key_scale=scales[0], value_scale=scales[1])
    logger.info_once(
        "attnhub-vllm: backend %r KV cache per layer: %d bytes in vLLM's tensor, %d bytes extra",
        backend.name,
        kv_cache.numel() * kv_cache.element_size(),
        extra_kv_bytes(cache, kv_cache),
    )
    return cache


def _requested_layout() -> str:
    """The attnhub layout of the backend vLLM's config or ``ATTNHUB_BACKEND`` names (NHD when
    neither does)."""
    try:
        name = configured_choice(get_current_vllm_config_or_none())[0]
    except AttnhubConfigurationError:
        name = None  # reported with its reason when the first layer is built
    name = name or os.environ.get(ENV_BACKEND)
    if name:
        try:
            return attnhub.get_backend(name).capabilities.kv_cache_layout
        except AttnhubError:
            pass  # reported with its reasons when the first layer is built
    return "NHD"


def _platform_updates_graphs() -> bool:
    """Whether vLLM's platform calls the impl class's ``update_graph_params`` after each FULL
    replay (vllm-ascend's model runner: ``update_full_graph_params``)."""
    from vllm.platforms import current_platform

    return current_platform.device_type == "npu"


class AttnhubVllmBackend(AttentionBackend):
    """vLLM's view of attnhub: one class for every attnhub backend."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    #: vLLM names the adapter maps (mapping.KV_CACHE_DTYPES); the chosen attnhub backend may
    #: still refuse a format at start with its reasons.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        # vLLM looks the name up in AttentionBackendEnum: it must be a member name.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[AttnhubVllmImpl]:
        return AttnhubVllmImpl

    @staticmethod
    def get_builder_cls() -> type[AttnhubVllmMetadataBuilder]:
        return AttnhubVllmMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # attnhub checks the block size against the chosen backend's capabilities at start.
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # vLLM's logical per-layer page is [B, H, N, C]; the physical order follows the
        # attnhub backend's layout: NHD -> [B, N, H, C], HND -> [B, H, N, C].
        if _requested_layout() == "HND":
            return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def cg_support(level: GraphSupport) -> AttentionCGSupport:
    """attnhub's graph level as vLLM's ``AttentionCGSupport``: the same names in the same
    order (NEVER < UNIFORM_SINGLE_TOKEN_DECODE < UNIFORM_BATCH < ALWAYS)."""
    return AttentionCGSupport[GraphSupport(level).name]


_LEVELS: dict[tuple[AttentionSpec, str, Choice], GraphSupport] = {}


def graph_level(
    spec: AttentionSpec, device: torch.device | str, choice: Choice = (None, False)
) -> GraphSupport:
    """The graph level of the attnhub builder serving ``spec``: its ``graph_support``, which
    may depend on the spec (ascend: NEVER for a sliding window or non-causal attention)."""
    key = (spec, str(device), choice)
    level = _LEVELS.get(key)
    if level is None:
        level = _LEVELS[key] = backend_for(spec, device, choice).metadata_builder().graph_support
    return level


def graph_level_of_config(vllm_config: VllmConfig, block_size: int) -> GraphSupport:
    """The lowest graph level over every attnhub layer of ``vllm_config`` (vLLM takes the
    lowest over its builders too); NEVER when it has none."""
    from vllm.model_executor.layers.attention import Attention

    device = vllm_config.device_config.device or "cpu"
    choice = configured_choice(vllm_config)
    specs = {
        layer.impl._spec(block_size)
        for layer in get_layers_from_vllm_config(vllm_config, Attention).values()
        if isinstance(layer.impl, AttnhubVllmImpl)
    }
    return min((graph_level(s, device, choice) for s in specs), default=GraphSupport.NEVER)


@dataclass
class _Graph:
    """One FULL graph vLLM captured: its descriptor and, per attnhub builder, the metadata
    ``build_for_graph_capture`` made over the adapter's persistent buffers (what the captured
    kernels read; the ascend backend's records its captured tasks)."""

    descriptor: GraphDescriptor
    metas: list[Any]


@dataclass
class GraphStep:
    """A step that runs a captured graph: the graph, this step's batch over the persistent
    buffers (refilled by ``build``), per builder the fence (an event recorded on the replay
    stream before this step's replay, after the previous one; None where the device has no
    events to order) and, once made, the ordinary metadata for a step vLLM runs eagerly."""

    graph: _Graph
    batch: BatchMetadata  # padded, over the persistent buffers
    real: BatchMetadata  # the step's real requests (vLLM's own tensors)
    fences: list[Any]
    owner: AttnhubVllmMetadataBuilder
    updated: bool = False
    eager: list[Any] | None = None

    def eager_metas(self) -> list[Any]:
        """Ordinary metadata of the real requests, made on first use: for a step vLLM runs
        outside the graph (its dispatcher's choice, e.g. a warm-up run)."""
        if self.eager is None:
            self.eager = [b.build(self.real) for b in self.owner._builders]
        return self.eager

    def update(self, update_stream: Any = None) -> None:
        """Every builder's ``update_graph_params`` for this step, once: on ``update_stream``
        (vllm-ascend's, handed by its model runner) or else the backend adaptor's, after the
        fence (the previous replay), never after a host synchronize."""
        if self.updated:
            return
        self.updated = True
        owner = self.owner
        for builder, adaptor, meta, fence in zip(
            owner._builders, owner._adaptors, self.graph.metas, self.fences, strict=True
        ):
            _ordered_update(adaptor, fence, update_stream, builder, meta, self.batch)


def _fence(adaptor: GraphAdaptor) -> Any:
    """An event recorded on the current (replay) stream now, after whatever replay came
    before, where the adaptor's device orders updates by events (an ``NPUGraphAdaptor``:
    ``adaptor.npu``); else None."""
    npu = getattr(adaptor, "npu", None)
    if npu is None:
        return None
    event = npu.Event()
    event.record(npu.current_stream())
    return event


def _ordered_update(
    adaptor: GraphAdaptor,
    fence: Any,
    stream: Any,
    builder: Any,
    meta: Any,
    batch: BatchMetadata,
) -> None:
    npu = getattr(adaptor, "npu", None)
    if stream is not None and npu is not None:  # the engine's update stream
        if fence is not None:
            stream.wait_event(fence)  # a device-side wait: the host goes on
        with npu.stream(stream):
            builder.update_graph_params(meta, batch, stream)
        return
    with adaptor.updating() as own:
        if fence is not None and own is not None:
            own.wait_event(fence)
        builder.update_graph_params(meta, batch, own)


@dataclass
class AttnhubVllmMetadata:
    """One step: the attnhub metadata per distinct layer spec (usually one), indexed by each
    layer's ``meta_index`` (a list: no spec hashing per layer call). ``graph``: set for a step
    of a captured FULL graph's shape (``metas`` are then the graph's)."""

    num_actual_tokens: int
    metas: list[Any] = field(default_factory=list)
    graph: GraphStep | None = None

    def layer_metas(self) -> list[Any]:
        """The metas a layer call runs with: the graph's while vLLM captures it (a FULL
        runtime mode in its forward context; it never calls a layer when it replays), the
        ordinary ones when it runs the step outside the graph."""
        graph = self.graph
        if graph is None or get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL:
            return self.metas
        return graph.eager_metas()


class AttnhubVllmMetadataBuilder(AttentionMetadataBuilder[AttnhubVllmMetadata]):
    #: What vLLM reads when nothing else is known; ``get_cudagraph_support`` gives the level of
    #: the attnhub backend that serves the config.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: Any
    ) -> AttentionCGSupport:
        """The attnhub builders' ``graph_support`` for this config's layers as vLLM's
        level (the lowest where layers differ): vLLM resolves its ``cudagraph_mode`` with it
        before any builder exists."""
        if dcp_.dcp_size(vllm_config) > 1:  # the DCP path is not captured (docs: vLLM settings)
            return AttentionCGSupport.NEVER
        return cg_support(graph_level_of_config(vllm_config, int(kv_cache_spec.block_size)))

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from vllm.model_executor.layers.attention import Attention

        self.block_size = int(kv_cache_spec.block_size)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        builders: dict[AttentionSpec, Any] = {}
        #: the group's attnhub layers: a FULL replay's step is compared with their caches
        self._impls: list[AttnhubVllmImpl] = []
        #: (the layers' caches when last looked at, one cache per distinct size among them)
        self._sized: tuple[tuple[Any, ...], list[PagedKVCache]] = ((), [])
        choice = configured_choice(vllm_config)
        checks = configured_checks(vllm_config)
        for layer in layers.values():  # once at start, not per step
            impl = layer.impl
            if not isinstance(impl, AttnhubVllmImpl):
                continue
            spec = impl.bind(self.block_size, device)  # raises with attnhub's reasons
            if spec not in builders:
                builders[spec] = backend_for(spec, device, choice).metadata_builder()
                builders[spec].checks = checks
            impl.meta_index = list(builders).index(spec)
            self._impls.append(impl)
        self._builders = list(builders.values())
        #: vLLM's decode context parallel: attnhub's sharding over vLLM's DCP group
        self._dcp = (
            dcp_.DcpPlanner([b.backend for b in self._builders], vllm_config, device)
            if dcp_.dcp_size(vllm_config) > 1
            else None
        )
        # vLLM's max_query_len / max_seq_len are exact unless speculative decoding makes
        # max_seq_len an optimistic bound: then the adapter reduces the lengths itself.
        self._exact_maxima = getattr(vllm_config, "speculative_config", None) is None
        # Plan one dummy step now, outside inference mode: a builder's first build may create
        # per-device constants it caches for the process (the ascend backend's compressed
        # mask); made inside vLLM's inference_mode they would be inference tensors.
        with torch.inference_mode(False):
            dummy = BatchMetadata.from_lengths([1], [1], [[0]], self.block_size, device=device)
            for b in self._builders:
                b.build(dummy)
        thresholds = [b.reorder_batch_threshold for b in self._builders]
        thresholds = [t for t in thresholds if t is not None]
        # vLLM reorders decodes (query_len <= threshold) first when a backend asks for it.
        self.reorder_batch_threshold = min(thresholds) if thresholds else None
        # FULL graphs: what vLLM captured, keyed by its (num_tokens, num_reqs), the persistent
        # buffers their metadata reads (made at the first capture) and the block table's width.
        self.graph_support = min(
            (b.graph_support for b in self._builders), default=GraphSupport.NEVER
        )
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._buffers: PersistentBatch | None = None
        self._adaptors: list[GraphAdaptor] = []
        max_model_len = vllm_config.model_config.max_model_len
        self._width = -(-int(max_model_len) // self.block_size)
        #: Where the per-step updates run: False (here, in ``build``: before vLLM replays the
        #: graph) or True (vllm-ascend: its model runner calls the impl class's
        #: ``update_graph_params`` with the step's forward context after the replay is
        #: launched; each captured task waits on the device for its update).
        self.deferred_updates = _platform_updates_graphs()

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> AttnhubVllmMetadata:
        """vLLM's capture of a FULL graph of this batch's shape (``num_actual_tokens`` a
        capture size T, ``num_reqs`` its descriptor's R): the attnhub batch padded the attnhub
        way into persistent buffers sized to vLLM's largest capture size, and each builder's
        ``build_for_graph_capture`` over them. Two kinds (``_dummy_run``): a uniform batch
        (R requests of the uniform-decode query length; dummy requests of that length pad a
        later step), or, for an ``ALWAYS`` backend under vLLM's ``FULL``, a mixed one (vLLM's
        ``max_query_len`` is then T: any batch of at most T tokens and R requests replays it).
        A mixed graph holds R requests where R == T, else R + 1: a later step's spare tokens
        need a dummy request of their own and vLLM's padding requests (no query token) are
        not attnhub requests; where dummies cannot make up the requests, causal requests are
        split (``attnhub.graphs.pad_batch``). Refused (typed, naming the batch) beyond the
        backends' graph level."""
        cm = common_attn_metadata
        key = (int(cm.num_actual_tokens), int(cm.num_reqs))
        tokens, reqs = key
        batch = batch_from_common(cm, self.block_size, num_reqs=real_requests(cm))
        q = uniform_query_len(batch)
        mixed = q is None or int(cm.max_query_len) > q or tokens != reqs * q
        level = self.graph_support
        if (
            level == GraphSupport.NEVER
            or (mixed and level < GraphSupport.ALWAYS)
            or (level == GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE and q != 1)
        ):
            raise AttnhubConfigurationError(
                f"attnhub-vllm: vLLM asks to capture a FULL graph of {tokens} tokens in {reqs} "
                f"requests (query lengths {batch.query_lens_cpu.tolist()}"
                f"{', a mixed batch' if mixed else ''}); the attnhub backends "
                f"({', '.join(b.backend.name for b in self._builders)}) capture "
                f"{level.name.lower()} batches"
            )
        if mixed and not batch.causal:
            raise AttnhubConfigurationError(
                f"attnhub-vllm: vLLM asks to capture a FULL graph of a mixed non-causal batch "
                f"({tokens} tokens in {reqs} requests); the adapter's mixed graphs split "
                "requests, which only causal attention allows"
            )
        if mixed:
            desc = GraphDescriptor(
                tokens, reqs if reqs == tokens else reqs + 1, uniform_decode=False, causal=True
            )
        else:
            desc = GraphDescriptor(tokens, reqs, uniform_decode=True, causal=batch.causal)
        step, _ = self._load(desc, batch)
        graph = _Graph(desc, [b.build_for_graph_capture(step) for b in self._builders])
        self._graphs[key] = graph
        fences = [None] * len(self._builders)  # a capture replays nothing: no update
        md = GraphStep(graph, step, batch, fences, self, updated=True)
        return AttnhubVllmMetadata(tokens, graph.metas, md)

    def _load(
        self, desc: GraphDescriptor, batch: BatchMetadata
    ) -> tuple[BatchMetadata, list[StepExtents]]:
        """``batch`` padded to ``desc`` and copied into the persistent buffers (on the current
        stream), checked in full by every builder; with each builder's extents of it."""
        if self._buffers is None:
            largest = self.vllm_config.compilation_config.max_cudagraph_capture_size
            largest = max(int(largest or 0), desc.num_tokens)
            self._buffers = PersistentBatch(
                largest, largest, self._width, self.block_size, self.device
            )
            self._adaptors = [b.backend.graph_adaptor() for b in self._builders]
        step = self._buffers.load(pad_batch(batch, desc, self._width), causal=batch.causal)
        return step, [b.check_graph_step(step) for b in self._builders]

    def _cache_sizes(self) -> list[PagedKVCache]:
        """One of the layers' attnhub caches per distinct (num_slots, num_blocks) among them
        (usually one: a KV-cache group's layers share vLLM's ``num_blocks``), found again only
        when a layer's cache changed (one identity comparison per layer per step). A layer not
        called yet has none: a captured graph holds only layers its capture called, which
        bound theirs."""
        caches = tuple(impl._cache for impl in self._impls)
        seen, sized = self._sized
        if len(seen) != len(caches) or any(a is not b for a, b in zip(seen, caches, strict=True)):
            sizes: dict[tuple[int, int], PagedKVCache] = {}
            for cache in caches:
                if cache is not None:
                    sizes.setdefault((cache.num_slots, cache.num_blocks), cache)
            sized = list(sizes.values())
            self._sized = (caches, sized)
        return sized

    def _check_replay(self, step: BatchMetadata, extents: list[StepExtents]) -> None:
        """A FULL replay's step fits the layers' caches (``check_extents``: integer comparisons
        with the step's host facts; no device read): a replay runs no Python, so no layer
        compares the step with its cache then, and a slot or block outside it would be written
        or read there. Raises InvalidInputError naming the slot or block, before the
        replay (and its updates)."""
        for cache in self._cache_sizes():
            for ext in extents:
                check_extents(ext, step, cache)

    def _graph_step(self, cm: CommonAttentionMetadata) -> AttnhubVllmMetadata | None:
        """The step of a captured graph when ``cm`` has its shape (vLLM pads a FULL step to
        its descriptor's token and request counts) and, for a uniform graph, its real requests
        are uniform with the graph's query length (a mixed graph takes any causal batch of
        its shape); else None."""
        graph = self._graphs.get((int(cm.num_actual_tokens), int(cm.num_reqs)))
        if graph is None:
            return None
        n = real_requests(cm)
        if not n:
            return None
        batch = batch_from_common(cm, self.block_size, num_reqs=n)
        desc = graph.descriptor
        if batch.causal != desc.causal:
            return None
        if desc.uniform_decode and uniform_query_len(batch) != desc.query_len:
            return None
        step, extents = self._load(desc, batch)
        self._check_replay(step, extents)
        fences = [_fence(a) for a in self._adaptors]
        md = GraphStep(graph, step, batch, fences, self)
        if not self.deferred_updates:
            md.update()  # before vLLM replays: attnhub's own order (docs/graphs.md)
        return AttnhubVllmMetadata(desc.num_tokens, graph.metas, md)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AttnhubVllmMetadata:
        if self._dcp is not None:  # every rank, every step: the shard's plan (no graphs)
            tokens, steps = self._dcp.plan(common_attn_metadata, self._exact_maxima)
            return AttnhubVllmMetadata(tokens, list(steps))
        if self._graphs:
            graph_step = self._graph_step(common_attn_metadata)
            if graph_step is not None:
                return graph_step
        batch = batch_from_common(
            common_attn_metadata, self.block_size, exact_maxima=self._exact_maxima
        )
        builders = self._builders
        if len(builders) == 1:  # the usual model: one spec for every layer
            return AttnhubVllmMetadata(batch.num_actual_tokens, [builders[0].build(batch)])
        return AttnhubVllmMetadata(batch.num_actual_tokens, [b.build(batch) for b in builders])


class AttnhubVllmImpl(AttentionImpl[AttnhubVllmMetadata]):
    #: The adapter serves vLLM's decode context parallel (attnhub_vllm.dcp) wherever the
    #: attnhub backend declares the LSE: each layer refuses at construction otherwise, and
    #: sets ``can_return_lse_for_decode`` from the declaration (``_declare_lse``). Any
    #: interleave with multi-token rows: every query row is its own decode over the shard.
    supports_dcp: ClassVar[bool] = True
    supports_mtp_with_cp_non_trivial_interleave_size: ClassVar[bool] = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.alibi_slopes = (
            None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        )
        self.sinks = sinks  # a parameter: its values are loaded after construction
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        config = get_current_vllm_config()
        self.dtype = config.model_config.dtype
        self.choice = configured_choice(config)
        self.spec: AttentionSpec | None = None
        self._impl: Any = None
        self.meta_index = 0  # set by the metadata builder
        self._cache_key: tuple[int, torch.Size] | None = None
        self._cache: PagedKVCache | None = None
        # Refuse at model construction where the block size is already known.
        block_size = config.cache_config.block_size
        if block_size:
            self.bind(int(block_size), "cpu" if config.device_config is None else None)
            self._declare_lse(config)

    def _declare_lse(self, config: VllmConfig) -> None:
        """vLLM's ``can_return_lse_for_decode`` from the attnhub backend's ``Capabilities.lse``
        for this layer, and ``need_to_return_lse_for_decode`` as vLLM's base computes it (its
        ``__new__`` read the class default, False); under decode context parallel, refuse at
        engine start with attnhub's reasons where the backend cannot serve it."""
        assert self.spec is not None
        device = config.device_config.device if config.device_config is not None else None
        backend = backend_for(self.spec, device or "cpu", self.choice)
        self.can_return_lse_for_decode = dcp_.declares_lse(backend, self.spec)
        self.need_to_return_lse_for_decode = (
            self.dcp_world_size > 1 and self.can_return_lse_for_decode
        )
        if self.dcp_world_size > 1:
            dcp_.refuse_unserved(backend, self.spec, self.dcp_world_size)

    @staticmethod
    def update_graph_params(
        update_stream: Any,
        forward_context: Any,
        num_tokens: int,
        vllm_config: VllmConfig,
        speculative_config: Any = None,
        num_dcp_pcp_tokens: int | None = None,
        draft_attn_metadatas: Any = None,
    ) -> None:
        """vllm-ascend's per-step hook (its model runner's ``update_full_graph_params`` calls
        ``impl_cls.update_graph_params`` after launching a FULL replay): the step's graph
        updates, found in ``forward_context.attn_metadata`` (one per distinct metadata, each
        once), launched on ``update_stream`` after the fence ``build`` recorded before the
        replay. No host synchronize."""
        md = forward_context.attn_metadata
        groups = md if isinstance(md, list) else [md]
        seen: set[int] = set()
        for group in groups:
            values = group.values() if isinstance(group, dict) else [group]
            for m in values:
                graph = m.graph if isinstance(m, AttnhubVllmMetadata) else None
                if graph is not None and id(m) not in seen:
                    seen.add(id(m))
                    graph.update(update_stream)

    def _spec(self, block_size: int) -> AttentionSpec:
        spec, reasons = spec_from_vllm(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=block_size,
            scale=self.scale,
            kv_cache_dtype=self.kv_cache_dtype,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            attn_type=self.attn_type,
            use_alibi=self.alibi_slopes is not None,
            use_sinks=self.sinks is not None,
        )
        if spec is None:
            raise AttnhubConfigurationError(
                "attnhub-vllm cannot map this layer: " + "; ".join(reasons)
            )
        return spec

    def bind(self, block_size: int, device: torch.device | str | None) -> AttentionSpec:
        """Fix this layer's spec (and check that the attnhub backend serves it)."""
        spec = self._spec(block_size)
        if device is None:
            device = get_current_vllm_config().device_config.device
        backend_for(spec, device or "cpu", self.choice)  # raises with attnhub's reasons
        if spec != self.spec:
            self.spec, self._impl, self._cache_key = spec, None, None
        return spec

    # --- per layer, per step -------------------------------------------------------------
    def _attnhub(self, device: torch.device) -> Any:
        """This layer's attnhub impl, made on its first call (sinks/slopes are loaded by
        then); callers read ``self._impl`` first, so a step pays one attribute read."""
        assert self.spec is not None, "the metadata builder binds every layer at start"
        backend = backend_for(self.spec, device, self.choice)
        self._impl = backend.impl(alibi_slopes=self.alibi_slopes, sinks=self.sinks)
        return self._impl

    def _paged(self, kv_cache: torch.Tensor, impl: Any, layer: Any) -> PagedKVCache:
        key = (kv_cache.data_ptr(), kv_cache.shape)
        if key != self._cache_key:  # once per layer (and per cache reallocation)
            scales = None
            if self.spec is not None and self.spec.kv_cache_format.is_quantized:
                scales = (layer._k_scale, layer._v_scale)  # fp8(x / scale), per tensor
            self._cache, self._cache_key = paged_cache(kv_cache, impl.backend, scales), key
        assert self._cache is not None
        return self._cache

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        impl = self._impl or self._attnhub(key.device)
        cache = self._paged(kv_cache, impl, layer)
        meta = self._step_meta(layer, slot_mapping)
        if isinstance(meta, dcp_.DcpLayerStep):  # the shard's planned write (vLLM's slots)
            meta.write(key, value, cache)
            return
        if meta is not None:  # the planned write, slots checked once per step: no sync here
            impl.write_kv(key, value, cache, meta=meta)
            return
        n = slot_mapping.shape[0]
        impl.write_kv(key[:n], value[:n], cache, slot_mapping)

    def _step_meta(self, layer: torch.nn.Module, slot_mapping: torch.Tensor) -> Any:
        """This step's attnhub metadata for this layer (from vLLM's forward context), when the
        slot mapping vLLM passes is the step's own; else None."""
        md = get_forward_context().attn_metadata
        if isinstance(md, dict):
            md = md.get(getattr(layer, "layer_name", None))
        if not isinstance(md, AttnhubVllmMetadata):
            return None
        metas = md.metas if md.graph is None else md.layer_metas()
        if md.graph is not None and metas is md.metas:
            # vLLM captures the graph: the slots it passes are its own buffer's, which the
            # adapter copied into the graph's; the captured write reads the graph's
            return metas[self.meta_index]
        meta = metas[self.meta_index]
        slots = meta.slots if isinstance(meta, dcp_.DcpLayerStep) else meta.batch.slot_mapping
        return meta if same_view(slot_mapping, slots) else None

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttnhubVllmMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise AttnhubConfigurationError(
                "attnhub-vllm: fused output quantization is not supported"
            )
        if attn_metadata is None:  # vLLM's warm-up / profiling run
            return output
        impl = self._impl or self._attnhub(query.device)
        if attn_metadata.graph is None:
            meta = attn_metadata.metas[self.meta_index]
        else:
            meta = attn_metadata.layer_metas()[self.meta_index]
        out = output.view(-1, self.num_heads, self.head_size)
        cache = self._paged(kv_cache, impl, layer)
        if isinstance(meta, dcp_.DcpLayerStep):  # decode context parallel (attnhub_vllm.dcp)
            meta.forward(impl, query.view(out.shape), cache, out)
            return output
        impl.forward(query, None, None, cache, meta, output=out)
        return output
