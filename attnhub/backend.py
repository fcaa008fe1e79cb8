"""The backend protocol: AttentionBackend -> AttentionMetadataBuilder (once per step) and
AttentionImpl (once per layer), as vLLM's v1 attention splits them and FlashInfer's plan()/run().

A backend author writes three small classes:
  - a backend: ``name``, ``capabilities``, ``metadata_builder()``, ``impl()``;
  - a builder: ``plan(batch, common_prefix_len)``: all host-side work of a step, once;
  - an impl: ``store_kv(...)`` and ``attend(...)``: per layer, thin.
The base classes do everything shared: refusing unsupported specs with reasons, validating every
call before anything is written, allocating caches and outputs.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch

from attnhub import validation
from attnhub.batch import BatchMetadata
from attnhub.capabilities import Capabilities, GraphSupport, Refusal
from attnhub.errors import (
    BackendUnavailableError,
    InvalidInputError,
    UnsupportedConfigurationError,
)
from attnhub.kv_cache import PagedKVCache
from attnhub.spec import AttentionSpec

if TYPE_CHECKING:
    from attnhub.graphs.adaptor import GraphAdaptor
    from attnhub.quant import LayerClipCounter


def device_type(device: torch.device | str) -> str:
    """ "cuda:0" -> "cuda"; works for device types torch has not registered (e.g. "npu")."""
    return str(device).split(":", 1)[0]


def as_device(device: torch.device | str) -> torch.device:
    """A torch.device, or raise InvalidInputError for a string torch does not know."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"device {device!r} is not a device torch knows: {exc}") from None


@dataclass(frozen=True)
class AttentionMetadata:
    """What a builder returns: the step's batch plus whatever the backend planned from it.

    Frozen: made once per step by ``build``, then only read by every layer (FlashInfer's
    plan / run). Backends subclass it (``@dataclass(frozen=True)`` too) with their planned
    fields. ``extents`` are the step's largest slot and block, found by ``build`` on host data,
    so that layers check them against their cache in O(1).
    """

    batch: BatchMetadata
    common_prefix_len: int = 0
    extents: validation.StepExtents | None = field(default=None, repr=False, compare=False)


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(abc.ABC):
    """A vendor's attention, bound to one spec and one device.

    Class-level facts answer before anything is built (``availability``,
    ``unsupported_reasons``); the constructor refuses with every reason at once.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    # --- questions answered before an instance exists --------------------------------------
    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        """None when this backend can run on ``device`` (natively or, with ``emulate``,
        through an emulator); otherwise why not."""
        dt = device_type(device)
        if not cls.capabilities.supports_device(dt):
            devices = sorted(cls.capabilities.devices or ())
            return f"device type {dt!r} is not supported (supported: {', '.join(devices)})"
        return None

    @classmethod
    def is_emulated(cls, device: torch.device | str) -> bool:
        """True when running on ``device`` means running through a CPU emulator."""
        return False

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        """Every reason this backend refuses ``spec`` (empty list = supported). Override to add
        limits of your own, or to explain a refusal per field::

            return [r.because(WHY[r.field]) if r.field in WHY else r
                    for r in super().unsupported_reasons(spec)]
        """
        return cls.capabilities.unsupported_reasons(spec)

    # --- an instance -----------------------------------------------------------------------
    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        why = self.availability(device, emulate)
        if why is not None:
            raise BackendUnavailableError(self.name, str(device), why)
        reasons = self.unsupported_reasons(spec)
        if reasons:
            raise UnsupportedConfigurationError(self.name, reasons)
        self.spec = spec
        self.device = as_device(device)
        self.emulate = emulate
        self.emulated = self.is_emulated(device)

    def __repr__(self) -> str:
        mode = ", emulated" if self.emulated else ""
        return f"<{type(self).__name__} {self.name!r} on {self.device}{mode}>"

    def allocate_kv_cache(self, num_blocks: int) -> PagedKVCache:
        """A zeroed cache for ``num_blocks`` blocks in this backend's layout and format."""
        return PagedKVCache.for_spec(
            self.spec, num_blocks, self.device, layout=self.capabilities.kv_cache_layout
        )

    def kv_cache_from_pages(self, pages: torch.Tensor) -> PagedKVCache | None:
        """This backend's cache laid out inside an engine's memory, one page per block.

        ``pages`` is ``[num_blocks, 2 * block_size * num_kv_heads * head_size]`` in the
        spec's storage dtype, each row (a dense run; rows any stride apart) all of one block's
        keys and values. A backend whose kernels keep a block in a layout of their own returns
        views of that layout inside each page, so its kernels read and write the engine's
        memory in place (no byte allocated beside it; page ``b`` holds block ``b`` alone).
        Scales of a quantized format are the engine's to attach. Default: None (no page layout
        of its own: the engine views its memory in ``capabilities.kv_cache_layout``)."""
        return None

    def graph_adaptor(self) -> GraphAdaptor:
        """The device-graph API this backend's graphs are captured with (attnhub.graphs):
        CUDA graphs on "cuda", the eager tape elsewhere. A backend whose graphs need its
        vendor's API (task-group updates) returns its adaptor."""
        from attnhub.graphs import default_adaptor

        return default_adaptor(self.device)

    @abc.abstractmethod
    def metadata_builder(self) -> AttentionMetadataBuilder[Any]:
        """The per-model builder; call ``build(batch)`` once per step."""

    @abc.abstractmethod
    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> AttentionImpl:
        """The per-layer implementation (ALiBi slopes and sinks are per-layer weights)."""


class AttentionMetadataBuilder(abc.ABC, Generic[M]):
    """Turns a step's BatchMetadata into the backend's metadata, once for all layers."""

    #: Requests with query_len <= this are decodes the backend wants first (None: any order).
    reorder_batch_threshold: ClassVar[int | None] = None

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.spec = backend.spec
        #: The step ``build`` is planning: its extents and the host facts read while checking
        #: it (query and sequence lengths as numpy, their extremes), set before ``plan``.
        self.step: validation.StepExtents | None = None
        #: ``build`` plans one step at a time: ``step`` and whatever scratch a backend's
        #: ``plan`` keeps on its builder belong to the step being planned, even where threads
        #: share the builder (the checks before it run unlocked).
        self._planning = threading.Lock()

    @property
    def graph_support(self) -> GraphSupport:
        return self.backend.capabilities.graph_capture

    def build(self, batch: BatchMetadata, *, common_prefix_len: int = 0) -> M:
        """Validate the batch and plan the step, on host data only (the batch's host copies):
        no device-to-host sync. Every value check of the step runs here, once for all layers.

        An integer tensor of the batch that is a strided view (e.g. every other entry of an
        engine's buffer) is made dense here, once for every layer: the metadata's batch holds
        the dense copy, so no kernel ever reads one through a raw pointer with the wrong
        stride."""
        given = batch
        batch = validation.dense_batch(batch)
        extents = validation.check_step(self.spec, batch, self.backend.device)
        self._check_batch_kinds(batch)
        if common_prefix_len:
            if not self.backend.capabilities.cascade:
                raise UnsupportedConfigurationError(
                    self.backend.name,
                    [
                        f"common_prefix_len = {common_prefix_len}: cascade attention is not "
                        "supported"
                    ],
                )
            validation.check_common_prefix(batch, common_prefix_len, extents)
        extents.owner = self.backend
        if batch is not given:
            extents.given_slot_mapping = given.slot_mapping
        with self._planning:
            self.step = extents  # what was read of the batch, for plan to reuse
            meta = self.plan(batch, common_prefix_len)
        object.__setattr__(meta, "extents", extents)  # the last touch: frozen from here on
        return meta

    def _check_batch_kinds(self, batch: BatchMetadata) -> None:
        """Refuse requests of a kind the backend does not declare.

        A request with cached context and query_len > 1 is a multi-token decode when
        query_len <= ``reorder_batch_threshold`` (speculative tokens), else a chunked prefill.
        """
        caps = self.backend.capabilities
        if caps.chunked_prefill and caps.multi_token_decode:
            return
        q = batch.query_lens_cpu
        with_context = (batch.seq_lens_cpu > q) & (q > 1)
        if not bool(with_context.any()):
            return
        threshold = max(1, self.reorder_batch_threshold or 1)
        kinds = (
            ("chunked prefill", caps.chunked_prefill, with_context & (q > threshold)),
            ("multi-token decode", caps.multi_token_decode, with_context & (q <= threshold)),
        )
        for kind, declared, found in kinds:
            if not declared and bool(found.any()):
                r = int(found.nonzero()[0, 0])
                raise UnsupportedConfigurationError(
                    self.backend.name,
                    [
                        f"request {r} (query_len {int(q[r])}, context_len "
                        f"{int(batch.seq_lens_cpu[r] - q[r])}) is a {kind}, which this backend "
                        "does not support"
                    ],
                )

    @abc.abstractmethod
    def plan(self, batch: BatchMetadata, common_prefix_len: int) -> M:
        """Backend-specific host-side work of one step (the batch is already validated)."""

    def build_for_graph_capture(self, batch: BatchMetadata) -> M:
        """Metadata for capturing a device graph of ``batch``'s shape.

        ``batch``'s device tensors are the graph runner's persistent buffers (refilled before
        every replay), its host copies the capture step's own. The metadata's tensors must be
        those buffers, or computed from them by device ops inside ``forward`` (which the
        graph captures): never host-planned from this batch's values, which every later
        replay would repeat. Host values a kernel takes are refreshed per step by
        :meth:`update_graph_params`. Default: ``build(batch)`` (right only for a backend
        whose ``plan`` keeps no per-step value outside the batch's tensors)."""
        self._check_graph_level(batch)
        validation.check_dense(batch, "a captured graph reads the batch's own tensors")
        return self.build(batch)

    def _check_graph_level(self, batch: BatchMetadata) -> None:
        """Refuse a capture beyond the declared ``graph_support`` (vLLM's AttentionCGSupport)."""
        level = self.graph_support
        if level == GraphSupport.NEVER:
            raise UnsupportedConfigurationError(
                self.backend.name, ["device-graph capture is not supported"]
            )
        if level == GraphSupport.ALWAYS or not batch.num_reqs:
            return
        q = batch.query_lens_cpu
        uniform = bool((q == q[0]).all())
        if not uniform or (level == GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE and int(q[0]) != 1):
            raise UnsupportedConfigurationError(
                self.backend.name,
                [
                    f"graph capture of this batch (query lengths {q.tolist()}): the backend "
                    f"captures {level.name.lower()} batches only"
                ],
            )

    def check_graph_step(self, batch: BatchMetadata) -> validation.StepExtents:
        """Every check ``build`` makes of a step, without planning it: for a step that replays
        a captured graph (the graph runner calls it on each padded batch). Returns the step's
        extents, to compare with every KV cache the graph writes or reads."""
        validation.check_batch_for_spec(self.spec, batch, self.backend.device)
        validation.check_dense(batch, "a captured graph reads the batch's own tensors")
        extents = validation.step_extents(batch)
        self._check_batch_kinds(batch)
        self._check_graph_level(batch)
        extents.owner = self.backend
        return extents

    def update_graph_params(self, graph_meta: M, batch: BatchMetadata, stream: Any) -> None:
        """Before a replay: refresh the host-side kernel arguments a captured graph baked in.

        ``graph_meta`` is what ``build_for_graph_capture`` returned for the graph (whatever
        ``forward`` recorded in it during capture included); ``batch`` is this step's, already
        checked by ``check_graph_step`` and copied into the persistent buffers. ``stream`` is
        the graph adaptor's update stream (None where the device has none), already ordered
        after the previous replay (docs/graphs.md, "Ordering"). Called for every replay,
        including the one right after capture. Default: nothing to refresh (a backend whose
        captured kernels read every per-step value from device tensors)."""
        return None


class AttentionImpl(abc.ABC):
    """One layer's attention: write the new keys/values, then attend over the cache."""

    #: Opt-in diagnostic (``attnhub.quant.ClipCounter.watch``): counts, on the device, the
    #: values this layer writes that its cache's static scales clip. None: not counted.
    clip_counter: LayerClipCounter | None = None

    def __init__(
        self,
        backend: AttentionBackend,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        self.backend = backend
        self.spec = spec = backend.spec
        self.alibi_slopes = self._per_head("alibi_slopes", alibi_slopes, spec.use_alibi)
        self.sinks = self._per_head("sinks", sinks, spec.use_sinks)
        #: The cache the checks accepted last: (cache, key, value, key_scale, value_scale,
        #: num_slots, num_blocks), one tuple so that threads sharing this impl each read a
        #: cache's planes and sizes together.
        self._checked_cache: tuple[Any, ...] | None = None
        #: The backend whose builders' metadata this layer accepts without comparing specs:
        #: its own, or the last other one found to be of the same kind, spec and device.
        self._owner_ok: object = backend

    def _per_head(
        self, name: str, t: torch.Tensor | None, declared: bool
    ) -> torch.Tensor | None:  # [num_heads] float32 on the backend's device
        flag = "use_alibi" if name == "alibi_slopes" else "use_sinks"
        if t is None:
            if declared:
                raise InvalidInputError(f"spec.{flag} is True but no {name} were given")
            return None
        if not declared:
            raise InvalidInputError(f"{name} were given but spec.{flag} is False")
        t = torch.as_tensor(t)
        if t.shape != (self.spec.num_heads,) or not t.is_floating_point():
            raise InvalidInputError(
                f"{name} must be a float tensor [num_heads={self.spec.num_heads}], "
                f"got {t.dtype} {list(t.shape)}"
            )
        return t.to(self.backend.device, torch.float32)

    # --- public calls ----------------------------------------------------------------------
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor | None = None,  # [n <= num_tokens] int, -1 = padding
        *,
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Write new keys/values to their slots; padding slots (-1) are skipped.

        With ``meta`` (this step's metadata from ``metadata_builder().build``), the slots are
        the step's ``meta.batch.slot_mapping`` (``slot_mapping`` may be left out, or must be
        that tensor) and the write reuses what the builder planned: the slot values were
        checked by ``build`` on host data, and this call compares only their extent with the
        cache (O(1), no device-to-host sync), as ``forward`` does. Without it, every call checks
        its own slot values on the host (a copy to the host where they live on an accelerator).
        """
        if (
            meta is not None
            and self._usual_step(cache, meta)
            and (
                slot_mapping is None
                or slot_mapping is meta.batch.slot_mapping
                or slot_mapping is meta.extents.given_slot_mapping  # type: ignore[union-attr]
            )
            and self._usual_kv(key, value, meta)
        ):  # the usual call: every shared check in one pass (see _usual_call)
            self.check_step(cache, meta)
            if self.clip_counter is not None:
                self.count_clipped(key, value, meta.batch.slot_mapping, cache)
            self.store_step_kv(key, value, cache, meta)
            return
        dev = self.backend.device
        self._check_cache(cache)
        if meta is not None:
            self._check_meta(meta)
            self.check_step(cache, meta)
            self._check_owner(meta)
            given = None if meta.extents is None else meta.extents.given_slot_mapping
            if (
                slot_mapping is not None
                and not validation.same_view(slot_mapping, meta.batch.slot_mapping)
                and (given is None or not validation.same_view(slot_mapping, given))
            ):
                raise InvalidInputError(
                    "slot_mapping is not meta.batch.slot_mapping: with meta=, leave slot_mapping "
                    "out (or pass the step's own)"
                )
            validation.check_kv(self.spec, key, value, dev, meta.batch.num_tokens)
            self._check_extents(meta, cache)
            if self.clip_counter is not None:
                self.count_clipped(key, value, meta.batch.slot_mapping, cache)
            self.store_step_kv(key, value, cache, meta)
            return
        if slot_mapping is None:
            raise InvalidInputError("write_kv needs slot_mapping or meta=")
        validation.check_tensor(
            "slot_mapping", slot_mapping, (None,), (torch.int32, torch.int64), dev
        )
        validation.check_kv(self.spec, key, value, dev, slot_mapping.shape[0])
        validation.check_slot_values(slot_mapping, cache)
        if not slot_mapping.is_contiguous():  # kernels read slots through a raw pointer
            slot_mapping = slot_mapping.contiguous()
        if self.clip_counter is not None:
            self.count_clipped(key, value, slot_mapping, cache)
        self.store_kv(key, value, cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size]; None: nothing new
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size] in spec.dtype
        """Write this step's keys/values (unless None), then attend for every query token.

        Rows past ``num_actual_tokens`` (padding) come back as zeros.
        """
        out = self.check_forward(query, key, value, cache, meta, output)
        if key is not None:
            assert value is not None
            if self.clip_counter is not None:
                self.count_clipped(key, value, meta.batch.slot_mapping, cache)
            self.store_step_kv(key, value, cache, meta)
        n = meta.batch.num_actual_tokens
        if out.shape[0] > n:
            out[n:].zero_()
        self.attend(query, key, value, cache, meta, out)
        return out

    def count_clipped(
        self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, cache: PagedKVCache
    ) -> None:
        """Count, with the opt-in ``clip_counter`` (when set), the values of a checked write
        that the cache's static scales clip (device ops only). ``forward`` and ``write_kv``
        call it; a backend whose ``forward`` fuses the write calls it before the fused call."""
        if self.clip_counter is None:
            return
        n = slots.shape[0]
        self.clip_counter.add(key[:n], value[:n], slots, cache)

    def _check_cache(self, cache: PagedKVCache) -> None:
        """check_cache, remembered for the last cache seen (and the very tensors it held): a
        model calls every layer with its own cache, step after step."""
        last = self._checked_cache
        if (
            last is not None
            and last[0] is cache
            and last[1] is cache.key
            and last[2] is cache.value
            and last[3] is cache.key_scale
            and last[4] is cache.value_scale
        ):
            return
        if not isinstance(cache, PagedKVCache):
            raise InvalidInputError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        planes = (cache, cache.key, cache.value, cache.key_scale, cache.value_scale)
        caps = self.backend.capabilities
        validation.check_cache(
            self.spec,
            caps.kv_cache_layout,
            cache,
            self.backend.device,
            strided=caps.strided_kv_cache,
        )
        self._checked_cache = (*planes, cache.num_slots, cache.num_blocks)

    @staticmethod
    def _check_meta(meta: object) -> None:
        if not isinstance(meta, AttentionMetadata):
            raise InvalidInputError(
                f"meta must be what this backend's metadata_builder().build(batch) returns, "
                f"got {type(meta).__name__}"
            )

    def _check_owner(self, meta: AttentionMetadata) -> None:
        """``meta`` was built for this layer: by a builder of this backend, or of another
        instance of its class with an equal spec on the same device. Metadata of another spec
        (another block size: slots and blocks of another geometry; another head size, window
        or scale: a plan for other kernels) would write K/V to the wrong blocks. O(1) after
        the first call: the accepted backend is remembered. (Metadata without extents is
        named by :meth:`_check_extents`.)"""
        extents = meta.extents
        if extents is None:
            return
        owner, mine = extents.owner, self.backend
        if owner is self._owner_ok:
            return
        if owner is mine:  # back to its own backend's steps: the one-pass check again
            self._owner_ok = mine
            return
        if not isinstance(owner, AttentionBackend):
            raise InvalidInputError(
                f"meta ({type(meta).__name__}) was not made by metadata_builder().build(batch) "
                "(its extents name no backend)"
            )
        if type(owner) is not type(mine):
            raise InvalidInputError(
                f"meta was built by the {owner.name!r} backend ({type(owner).__name__}); this "
                f"layer's is {mine.name!r} ({type(mine).__name__})"
            )
        if owner.spec != mine.spec:
            raise InvalidInputError(
                "meta was built for another spec than this layer's: "
                + validation.spec_differences(owner.spec, mine.spec)
                + " (build each layer's steps with a builder of its own spec)"
            )
        if not validation.same_device(owner.device, mine.device):
            raise InvalidInputError(
                f"meta was built for {owner.device}; this layer runs on {mine.device}"
            )
        self._owner_ok = owner

    def _check_extents(self, meta: AttentionMetadata, cache: PagedKVCache) -> None:
        """The step's slots and blocks (found by ``build``) fit this cache: O(1), two integer
        comparisons with the sizes remembered when the cache was checked."""
        extents = meta.extents
        if extents is None:
            raise InvalidInputError(
                f"meta ({type(meta).__name__}) was not made by metadata_builder().build(batch)"
            )
        last = self._checked_cache
        if (
            last is None
            or last[0] is not cache
            or extents.max_slot >= last[5]
            or extents.max_block >= last[6]
        ):
            validation.check_extents(extents, meta.batch, cache)  # names what does not fit

    def check_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        output: torch.Tensor | None,
    ) -> torch.Tensor:
        """Validate a forward call completely (nothing written yet); return the output buffer."""
        if self._usual_call(query, key, value, cache, meta, output):
            self.check_step(cache, meta)
            return torch.empty_like(query) if output is None else output
        spec, dev = self.spec, self.backend.device
        self._check_meta(meta)
        batch = meta.batch
        self._check_cache(cache)
        self.check_step(cache, meta)
        self._check_owner(meta)
        q = validation.check_tensor(
            "query", query, (None, spec.num_heads, spec.head_size), spec.dtype, dev
        )
        if q.shape[0] < batch.num_actual_tokens:
            raise InvalidInputError(
                f"query has {q.shape[0]} tokens, the batch has {batch.num_actual_tokens}"
            )
        if (key is None) != (value is None):
            raise InvalidInputError("key and value must both be given or both be None")
        if key is not None:
            validation.check_kv(spec, key, value, dev, batch.num_tokens)
        if output is None:
            output = torch.empty_like(q)
        else:
            validation.check_tensor("output", output, tuple(q.shape), spec.dtype, dev)
        self._check_extents(meta, cache)
        return output

    # --- the usual call, checked in one pass --------------------------------------------------
    # A model calls every layer with its own cache, step after step, with tensors of the spec's
    # shapes: these test every condition of the shared checks above in one expression each (no
    # function per tensor, no error text), against the cache the checks accepted last (the very
    # planes) and the sizes they remembered. They raise nothing: where a condition does not
    # hold, or holds only in another spelling (an equivalent device), the checks above run and
    # name what is wrong. tests/test_usual_call.py holds both paths to the same outcomes.

    def _usual_step(self, cache: object, meta: object) -> bool:
        """An AttentionMetadata made by build for this layer (its backend, or one accepted
        before), whose extents fit the cache the checks accepted last (the same cache object
        and planes)."""
        last = self._checked_cache
        if not (
            last is not None
            and last[0] is cache
            and isinstance(cache, PagedKVCache)
            and last[1] is cache.key
            and last[2] is cache.value
            and last[3] is cache.key_scale
            and last[4] is cache.value_scale
            and isinstance(meta, AttentionMetadata)
        ):
            return False
        extents = meta.extents
        return (
            extents is not None
            and extents.owner is self._owner_ok
            and extents.max_slot < last[5]
            and extents.max_block < last[6]
        )

    def _usual_call(
        self,
        query: object,
        key: object,
        value: object,
        cache: object,
        meta: object,
        output: object,
    ) -> bool:
        """Every shared check of ``check_forward`` holds (``check_step`` apart)."""
        if not self._usual_step(cache, meta):
            return False
        assert isinstance(meta, AttentionMetadata)
        spec, dev = self.spec, self.backend.device
        if not (
            isinstance(query, torch.Tensor) and query.dtype is spec.dtype and query.device == dev
        ):
            return False
        qs = query.shape
        if not (
            len(qs) == 3
            and qs[1] == spec.num_heads
            and qs[2] == spec.head_size
            and qs[0] >= meta.batch.num_actual_tokens
        ):
            return False
        if output is not None and not (
            isinstance(output, torch.Tensor)
            and output.shape == qs
            and output.dtype is spec.dtype
            and output.device == dev
        ):
            return False
        if key is None:
            return value is None
        return self._usual_kv(key, value, meta)

    def _usual_kv(self, key: object, value: object, meta: AttentionMetadata) -> bool:
        """``validation.check_kv``'s conditions for the step's new keys and values."""
        if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
            return False
        spec, dev = self.spec, self.backend.device
        ks, vs = key.shape, value.shape
        return (
            len(ks) == 3
            and len(vs) == 3
            and ks[1] == spec.num_kv_heads
            and vs[1] == spec.num_kv_heads
            and ks[2] == spec.head_size
            and vs[2] == spec.head_size
            and ks[0] == vs[0]
            and ks[0] >= meta.batch.num_tokens
            and key.dtype is spec.dtype
            and value.dtype is spec.dtype
            and key.device == dev
            and value.device == dev
        )

    def check_step(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        """Backend-specific checks of a call with a step's metadata (``forward`` and
        ``write_kv(meta=)``), before anything is written: e.g. that ``meta`` is this backend's
        own kind, or that the cache's storage suits its kernels. Raise InvalidInputError.
        Default: nothing beyond the shared checks."""
        return None

    # --- what a backend implements ---------------------------------------------------------
    @abc.abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write keys/values (already validated) to the cache; skip slots < 0."""

    def store_step_kv(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata
    ) -> None:
        """The KV write of ``forward``; override to use what the builder planned for the step
        (e.g. slots already filtered of padding). Default: ``store_kv`` with the slot mapping."""
        self.store_kv(key, value, cache, meta.batch.slot_mapping)

    @abc.abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Attention of every query token of ``meta.batch`` over the cache, into ``out``.

        ``key``/``value`` are this step's new tokens (already in the cache), or None; a backend
        may use them where that is cheaper than reading the cache back.
        """
