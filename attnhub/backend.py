"""The backend protocol: AttentionBackend -> AttentionMetadataBuilder (once per step) and
AttentionImpl (once per layer), as vLLM's v1 attention splits them and FlashInfer's plan()/run().

A backend author writes three small classes and about four methods::

    build(batch)   -> the core's checks -> Step -> builder.plan(step) -> metadata (frozen)
    forward(...)   -> the core's checks -> impl.compute(...) = store_kv(...); attend(...)
    write_kv(...)  -> the core's checks -> impl.store_kv(...)

  - a backend: ``name``, ``capabilities`` (data), ``builder_type``, ``impl_type``;
  - a builder: ``plan(step)``: all host-side work of a step, once, returning the planned
    fields of its ``metadata_type``;
  - an impl: ``store_kv(...)`` and ``attend(...)`` (or ``compute(...)``, for a kernel that
    writes and attends in one call): per layer, thin.
The base classes do everything shared: refusing unsupported specs with reasons, validating every
call before anything is written, making the metadata, allocating caches and outputs.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Generic,
    Literal,
    NamedTuple,
    TypeVar,
    cast,
    overload,
)

import torch

from attnhub import validation
from attnhub.batch import BatchMetadata
from attnhub.capabilities import Capabilities, GraphSupport, Refusal
from attnhub.errors import (
    BackendUnavailableError,
    InvalidInputError,
    UnsupportedConfigurationError,
)
from attnhub.kv_cache import BlockPacking, PagedKVCache
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.spec import AttentionSpec
from attnhub.validation import Let, Rule, StepExtents, StepFacts

if TYPE_CHECKING:
    from attnhub.graphs.adaptor import GraphAdaptor
    from attnhub.mla_backend import MLAImpl
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


#: The ``dataclasses.field`` metadata key that marks a metadata field as scratch.
SCRATCH = "attnhub_scratch"


def scratch_field(**kwargs: Any) -> Any:
    """A field of a backend's metadata that layers may write into: a workspace, a gather
    buffer, a captured graph's task list. Every other field is complete when ``build`` returns
    and only read afterwards (the conformance suite holds every backend to it:
    ``test_plan_complete``). Takes ``dataclasses.field``'s arguments (default None)."""
    if "default_factory" not in kwargs:
        kwargs.setdefault("default", None)
    kwargs.setdefault("repr", False)
    kwargs.setdefault("compare", False)
    return field(metadata={SCRATCH: True}, **kwargs)


def is_scratch(f: Any) -> bool:
    """Whether the dataclass field ``f`` was declared with :func:`scratch_field`."""
    return bool(f.metadata.get(SCRATCH, False))


@dataclass(frozen=True)
class AttentionMetadata:
    """What a builder returns: the step's batch plus whatever the backend planned from it.

    Frozen and complete: made once per step by ``build`` (the base class makes it, from the
    builder's ``plan``), then only read by every layer (FlashInfer's plan / run): no field is
    written afterwards but those declared with :func:`scratch_field`. Backends subclass it
    (``@dataclass(frozen=True)`` too) with their planned fields. ``extents`` are the step's
    largest slot and block, found by ``build`` on host data, so that layers check them against
    their cache in O(1) (-1 each where the builder's ``checks`` are structural: nothing read,
    nothing bounded), and the backend that built it.
    """

    batch: BatchMetadata
    common_prefix_len: int = 0
    extents: StepExtents | None = field(default=None, repr=False, compare=False)


class Step(NamedTuple):  # immutable, and made at a third of a frozen dataclass's cost
    """A checked step, as ``build`` hands it to the builder's planning hook (``plan(step)``).

    ``batch`` is dense (a strided integer tensor of the engine's was copied once here);
    ``extents`` are what layers compare in O(1) (largest slot and block, the owner backend,
    the engine's own slot mapping where ``batch`` holds a dense copy of it); ``facts`` are the
    host facts the checks read on the way (query and sequence lengths as numpy, their
    extremes, the block table; None where the checks were structural)."""

    batch: BatchMetadata
    facts: StepFacts
    extents: StepExtents
    common_prefix_len: int = 0

    @property
    def backend(self) -> AttentionBackend:
        """The backend whose builder checked the step."""
        return cast(AttentionBackend, self.extents.owner)

    @property
    def given_slot_mapping(self) -> torch.Tensor:
        """The slot mapping the engine gave (``batch.slot_mapping``, or the strided view it is
        a dense copy of)."""
        given = self.extents.given_slot_mapping
        return self.batch.slot_mapping if given is None else given


M = TypeVar("M", bound=AttentionMetadata)


class _MetadataMaker:
    """Makes one frozen metadata class from keyword values at a third of its ``__init__``'s
    cost (which sets each field through ``object.__setattr__``, ~0.12 us a field, on every
    step): the values, defaults and default factories go into a new instance's ``__dict__``
    at once. The same fields, the same errors for a missing or unknown name; a class this
    cannot make so (slots, ``__post_init__``, not a dataclass) is made by its constructor."""

    def __init__(self, cls: type[AttentionMetadata]) -> None:
        self.cls = cls
        fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
        self.direct = (
            bool(fields)
            and "__dict__" in dir(cls)
            and not hasattr(cls, "__slots__")
            and not hasattr(cls, "__post_init__")
        )
        names = frozenset(f.name for f in fields if f.init)
        self.count = len(names)
        self.defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        self.factories = tuple(
            (f.name, f.default_factory)
            for f in fields
            if f.default_factory is not dataclasses.MISSING
        )
        self.required = names - self.defaults.keys() - {n for n, _ in self.factories}
        self.batch_only = self.required == {"batch"}

    def __call__(self, values: dict[str, Any]) -> AttentionMetadata:
        if self.direct:
            made, state = self._defaulted()
            state.update(values)
            if len(state) == self.count and self.required <= state.keys():
                return made
        return self.cls(**values)  # (its own error for a missing or unknown name)

    def _defaulted(self) -> tuple[AttentionMetadata, dict[str, Any]]:
        """A new instance, not initialized, and its ``__dict__`` holding the defaults and a
        value of each default factory. The count of fields then matches, once the given
        values are in, only where every field is given once and no other name (required
        fields being all those without a default)."""
        made = _NEW(self.cls)
        state = made.__dict__
        state.update(self.defaults)
        for name, factory in self.factories:
            state[name] = factory()
        return made, state

    def of_step(self, step: Step, planned: Mapping[str, Any]) -> AttentionMetadata:
        """The metadata of a checked step and what was planned for it (``__call__`` with the
        base fields taken from the step, without a dict of them)."""
        if self.direct:
            made, state = self._defaulted()
            state["batch"], _, state["extents"], state["common_prefix_len"] = step
            state.update(planned)
            # (the base fields set here: the other required ones must come from the plan)
            if len(state) == self.count and (self.batch_only or self.required <= state.keys()):
                return made
        batch, _, extents, common_prefix_len = step
        return self.cls(
            batch=batch, common_prefix_len=common_prefix_len, extents=extents, **planned
        )


_NEW = object.__new__
_TUPLE_NEW = tuple.__new__
_MAKERS: dict[type[AttentionMetadata], _MetadataMaker] = {}


def _metadata_maker(cls: type[AttentionMetadata]) -> _MetadataMaker:
    """The maker of ``cls`` (made once a class)."""
    maker = _MAKERS.get(cls)
    if maker is None:
        maker = _MAKERS[cls] = _MetadataMaker(cls)
    return maker


class AttentionBackend(abc.ABC):
    """A vendor's attention, bound to one spec and one device.

    Class-level facts answer before anything is built (``availability``,
    ``unsupported_reasons``); the constructor refuses with every reason at once.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    #: The layer's spec (an ``MLASpec`` where :attr:`is_mla`: read it through the MLA classes).
    spec: AttentionSpec
    #: Whether the instance serves an MLA layer (its spec an :class:`attnhub.mla.MLASpec`).
    is_mla: bool = False

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

        An MLA layer's spec (:class:`attnhub.mla.MLASpec`) is answered by
        :meth:`mla_unsupported_reasons` instead, before any override of this method runs
        (an override written for ``AttentionSpec`` never sees one)."""
        if isinstance(spec, MLASpec):
            return cls.mla_unsupported_reasons(spec)
        return cls.capabilities.unsupported_reasons(spec)

    @classmethod
    def mla_unsupported_reasons(cls, spec: MLASpec) -> list[Refusal]:
        """Every reason this backend refuses the MLA layer ``spec`` (empty = served): the
        declared ``capabilities.mla`` (its ``because`` explains a field). Override to add
        limits of your own."""
        return cls.capabilities.mla.unsupported_reasons(spec)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An override of ``unsupported_reasons`` answers standard specs; an MLA spec goes to
        ``mla_unsupported_reasons`` first (one dispatch on the spec's kind, here)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("unsupported_reasons")
        if isinstance(own, classmethod) and not getattr(own.__func__, "_mla_dispatch", False):
            standard = own.__func__

            def unsupported_reasons(
                klass: type[AttentionBackend], spec: AttentionSpec
            ) -> list[Refusal]:
                if isinstance(spec, MLASpec):
                    return klass.mla_unsupported_reasons(spec)
                return standard(klass, spec)

            unsupported_reasons.__doc__ = standard.__doc__
            unsupported_reasons.__wrapped__ = standard  # type: ignore[attr-defined]
            unsupported_reasons._mla_dispatch = True  # type: ignore[attr-defined]
            cls.unsupported_reasons = classmethod(unsupported_reasons)  # type: ignore[assignment]

    # --- an instance -----------------------------------------------------------------------
    def __init__(
        self,
        spec: AttentionSpec | MLASpec,
        device: torch.device | str = "cpu",
        *,
        emulate: bool = False,
    ) -> None:
        why = self.availability(device, emulate)
        if why is not None:
            raise BackendUnavailableError(self.name, str(device), why)
        reasons = self.unsupported_reasons(spec)  # type: ignore[arg-type]
        if reasons:
            raise UnsupportedConfigurationError(self.name, reasons)
        #: The layer's spec: an ``AttentionSpec``, or an ``MLASpec`` for an MLA layer
        #: (:attr:`is_mla`; its builder and impl are ``mla_builder_type`` / ``mla_impl_type``).
        self.spec = spec  # type: ignore[assignment]
        self.is_mla = isinstance(spec, MLASpec)
        self.device = as_device(device)
        self.emulate = emulate
        self.emulated = self.is_emulated(device)

    def __repr__(self) -> str:
        mode = ", emulated" if self.emulated else ""
        return f"<{type(self).__name__} {self.name!r} on {self.device}{mode}>"

    #: How this backend's kernels pack each block of its own caches, where no strided view shows
    #: a block as tokens x channels (``PagedKVCache.packing``); None: they do not. A cache
    #: packed otherwise is refused; an unpacked one is the backend's to accept or refuse.
    kv_packing: BlockPacking | None = None

    #: The vendor op namespace this instance calls its kernels through (the vendor library, or
    #: its emulator; set in ``__init__``), or None: the backend calls none (``torch``). A declared
    #: hook of the tools: the impls read it through the backend at each call
    #: (``self.backend.ops.name(...)``), never keeping a function of it, so that ``attnhub bench
    #: --host`` can replace it on one instance by no-ops (``attnhub.bench.noop_ops``) and time
    #: the backend's own Python alone.
    ops: Any = None

    def allocate_kv_cache(self, num_blocks: int) -> PagedKVCache:
        """A zeroed cache for ``num_blocks`` blocks in this backend's layout and format (an
        MLA layer's: a ``LatentKVCache`` in the first of ``capabilities.mla.layouts``)."""
        if self.is_mla:
            return LatentKVCache.for_spec(  # type: ignore[return-value]
                cast(MLASpec, self.spec),
                num_blocks,
                self.device,
                layout=self.capabilities.mla.layouts[0],
            )
        return PagedKVCache.for_spec(
            self.spec, num_blocks, self.device, layout=self.capabilities.kv_cache_layout
        )

    def kv_cache_from_pages(self, pages: torch.Tensor) -> PagedKVCache | None:
        """This backend's cache laid out inside an engine's memory, one page per block.

        ``pages`` is ``[num_blocks, block_size * num_kv_heads * (head_size + head_size_v)]``
        in the spec's storage dtype, each row (a dense run; rows any stride apart) all of one
        block's keys and values. A backend whose kernels keep a block in a layout of their own
        returns views of that layout inside each page, so its kernels read and write the
        engine's memory in place (no byte allocated beside it; page ``b`` holds block ``b``
        alone).
        Scales of a quantized format are the engine's to attach. Default: None (no page layout
        of its own: the engine views its memory in ``capabilities.kv_cache_layout``)."""
        return None

    def graph_adaptor(self) -> GraphAdaptor:
        """The device-graph API this backend's graphs are captured with (attnhub.graphs):
        CUDA graphs on "cuda", the eager tape elsewhere. A backend whose graphs need its
        vendor's API (task-group updates) returns its adaptor."""
        from attnhub.graphs import default_adaptor

        return default_adaptor(self.device)

    #: The builder class ``metadata_builder()`` makes (called with this backend).
    builder_type: ClassVar[type[AttentionMetadataBuilder[Any]]]
    #: The impl class ``impl()`` makes (called with this backend and the per-layer weights).
    impl_type: ClassVar[type[AttentionImpl]]

    #: An MLA layer's builder class (None: ``attnhub.mla_backend.MLAMetadataBuilder``, which
    #: plans nothing) and impl class (an ``attnhub.mla_backend.MLAImpl``; None: no MLA).
    mla_builder_type: ClassVar[type[AttentionMetadataBuilder[Any]] | None] = None
    mla_impl_type: ClassVar[type[MLAImpl] | None] = None

    def metadata_builder(self) -> AttentionMetadataBuilder[Any]:
        """The per-model builder (``builder_type``; an MLA layer's ``mla_builder_type``); call
        ``build(batch)`` once per step."""
        if self.is_mla:
            from attnhub.mla_backend import MLAMetadataBuilder

            return (self.mla_builder_type or MLAMetadataBuilder)(self)
        return self.builder_type(self)

    def impl(
        self, *, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None
    ) -> AttentionImpl:
        """The per-layer implementation (``impl_type``; ALiBi slopes and sinks are per-layer
        weights). An MLA layer's is ``mla_impl_type`` (an ``MLAImpl``: ``forward(q, kv_c,
        k_pe, cache, meta)``), which takes no ALiBi slopes or sinks."""
        if self.is_mla:
            if alibi_slopes is not None or sinks is not None:
                raise InvalidInputError("an MLA layer takes no alibi_slopes or sinks")
            if self.mla_impl_type is None:
                raise UnsupportedConfigurationError(
                    self.name, ["MLA: capabilities.mla is declared but no mla_impl_type is set"]
                )
            return self.mla_impl_type(self)  # type: ignore[return-value]
        return self.impl_type(self, alibi_slopes=alibi_slopes, sinks=sinks)


class AttentionMetadataBuilder(Generic[M]):
    """Turns a step's BatchMetadata into the backend's metadata, once for all layers:
    ``build`` checks the step, hands it to ``plan`` and makes ``metadata_type`` of what
    ``plan`` returns."""

    #: Requests with query_len <= this are decodes the backend wants first (None: any order).
    reorder_batch_threshold: ClassVar[int | None] = None
    #: The metadata class ``build`` makes: ``AttentionMetadata`` or a frozen dataclass
    #: subclass of it whose fields beyond the base's are what ``plan`` returns.
    metadata_type: ClassVar[type[AttentionMetadata]] = AttentionMetadata

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend
        self.spec = backend.spec
        self._checks = "full"
        #: The step checks ``checks`` names (:func:`validation.checked_step` or
        #: :func:`validation.checked_structure`): (spec, batch, device) -> (the dense batch,
        #: its StepFacts).
        self._check_facts: Callable[
            [AttentionSpec, BatchMetadata, torch.device], tuple[BatchMetadata, StepFacts]
        ] = validation.checked_step
        #: Whether ``_check_batch_kinds`` may refuse a step (it returns at once, unless a
        #: subclass checks more, where every kind of request is declared).
        caps = backend.capabilities
        self._kinds_refusable = not (caps.chunked_prefill and caps.multi_token_decode) or (
            type(self)._check_batch_kinds is not AttentionMetadataBuilder._check_batch_kinds
        )
        #: The extents of every dense step checked for its structure only: nothing read,
        #: nothing bounded (-1 each), this backend's (one instance, read only).
        self._unbounded = StepExtents(-1, -1, backend, None)

    @property
    def checks(self) -> str:
        """What ``build`` checks of a step. ``"full"`` (the default): everything, its values
        included (every slot -1 or distinct, every block a request reads not negative, lengths
        consistent; O(tokens + blocks) on host data, once per step), so that each layer only
        compares the step's extents with its cache. ``"structural"``: the batch's kind, shapes,
        dtypes and devices only (O(1) per step, no value read), for an engine that builds each
        step itself and trusts its own slots, tables and lengths: the trade-off vLLM's and
        FlashInfer's own builders make. A wrong value then reaches the kernels unchecked (an
        out-of-range slot may write outside the cache); layer calls still check their own
        arguments in full."""
        return self._checks

    @checks.setter
    def checks(self, value: str) -> None:
        if value not in ("full", "structural"):
            raise InvalidInputError(f"checks = {value!r} must be 'full' or 'structural'")
        self._checks = value
        self._check_facts = (
            validation.checked_step if value == "full" else validation.checked_structure
        )

    @property
    def graph_support(self) -> GraphSupport:
        return self.backend.capabilities.graph_capture

    def build(self, batch: BatchMetadata, *, common_prefix_len: int = 0) -> M:
        """Validate the batch and plan the step, on host data only (the batch's host copies):
        no device-to-host sync. Every value check of the step runs here, once for all layers;
        the metadata returned is complete (``plan`` made every per-step kernel argument).

        An integer tensor of the batch that is a strided view (e.g. every other entry of an
        engine's buffer) is made dense here, once for every layer: the metadata's batch holds
        the dense copy, so no kernel ever reads one through a raw pointer with the wrong
        stride."""
        step = self.check_step(batch, common_prefix_len)
        return self.metadata(step, self.plan(step))

    def check_step(self, batch: BatchMetadata, common_prefix_len: int = 0) -> Step:
        """Every check ``build`` makes of a step (as ``checks`` says), without planning it:
        the checked step, as ``plan`` receives it."""
        given = batch
        batch, facts = self._check_facts(self.spec, batch, self.backend.device)
        if self._kinds_refusable:
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
            validation.check_common_prefix(batch, common_prefix_len, facts)
        if facts is validation.STRUCTURAL_FACTS and batch is given:
            extents = self._unbounded
        else:
            extents = StepExtents(
                facts.max_slot,
                facts.max_block,
                self.backend,
                None if batch is given else given.slot_mapping,
            )
        return _TUPLE_NEW(Step, (batch, facts, extents, common_prefix_len))  # (Step(...), faster)

    def plan(self, step: Step) -> Mapping[str, Any]:
        """Backend-specific host-side work of one checked step: the values of the fields of
        ``metadata_type`` beyond the base's (every per-step kernel argument: layers only read
        them; a buffer layers write into is declared with ``scratch_field``). Default: none."""
        return {}

    def metadata(self, step: Step, planned: Mapping[str, Any]) -> M:
        """The step's metadata: ``metadata_type`` of the step and what was planned for it."""
        maker = _MAKERS.get(self.metadata_type) or _metadata_maker(self.metadata_type)
        return maker.of_step(step, planned)  # type: ignore[return-value]

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

    def build_for_graph_capture(self, batch: BatchMetadata) -> M:
        """Metadata for capturing a device graph of ``batch``'s shape.

        ``batch``'s device tensors are the graph runner's persistent buffers (refilled before
        every replay), its host copies the capture step's own. The metadata's tensors must be
        those buffers, or computed from them by device ops inside ``forward`` (which the
        graph captures): never host-planned from this batch's values, which every later
        replay would repeat. Host values a kernel takes are refreshed per step by
        :meth:`update_graph_params`. Default: ``build(batch)`` (right only for a backend
        whose ``plan`` keeps no per-step value outside the batch's tensors). A backend that
        overrides it plans from :meth:`capture_step`."""
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

    def check_graph_step(self, batch: BatchMetadata) -> StepExtents:
        """Every check ``build`` makes of a step, without planning it: for a step that replays
        a captured graph (the graph runner calls it on each padded batch). Returns the step's
        extents, to compare with every KV cache the graph writes or reads."""
        return self.capture_step(batch).extents

    def capture_step(self, batch: BatchMetadata) -> Step:
        """The checked step of a graph capture or replay: every check ``build`` makes, always
        in full, and the batch's tensors dense and its kind within ``graph_support``."""
        facts = validation.check_step(self.spec, batch, self.backend.device)
        validation.check_dense(batch, "a captured graph reads the batch's own tensors")
        self._check_batch_kinds(batch)
        self._check_graph_level(batch)
        return Step(batch, facts, StepExtents(facts.max_slot, facts.max_block, self.backend))

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


# --- the rules of a layer call (facts: the impl and the call's arguments) --------------------

_NAMES = {
    "AttentionMetadata": AttentionMetadata,
    "validation": validation,
    "kv_passes": validation.KV.passes,  # one name to look up, on every call
}

#: The call's metadata is a step's (its kind; the backend's own checks, ``check_call``).
META_KIND = Rule(
    "isinstance(meta, AttentionMetadata)",
    "meta must be what this backend's metadata_builder().build(batch) returns, "
    "got {type(meta).__name__}",
)
#: The cache the impl's checks accepted last: (cache, key, value, key_scale, value_scale,
#: num_slots, num_blocks), read once per call.
LAST = Let("last", "self._checked_cache")
#: The cache is the one the checks accepted last, the very planes (else it is checked in full
#: and remembered: ``_accept_cache``).
CACHE_REMEMBERED = Rule(
    "last is not None and last[0] is cache and last[1] is cache.key and last[2] is cache.value "
    "and last[3] is cache.key_scale and last[4] is cache.value_scale",
    otherwise="self._accept_cache(cache)",
)
#: The cache's per-tensor (fp8) scales hold values this layer found finite and non-zero (their
#: storage and version counters looked up, no value read: ``_check_scale_values`` reads them
#: when an engine sets or replaces them, or on a cache this impl has not seen them in).
SCALES_SEEN = Rule(
    "not self._tensor_scales "
    "or validation.tensor_scale_key(cache, self._tensor_scales) in self._scales_seen",
    otherwise="self._check_scale_values(cache)",
)
BACKEND_CHECKS = Rule("self.check_call(cache, meta) or True")  # raises its own errors
#: What the rules below read of the impl and the step.
FACTS = [
    Let("spec", "self.spec"),
    Let("device", "self.backend.device"),
    Let("extents", "meta.extents"),
]
#: Built by a builder of this layer's backend, or of one accepted before (``_check_owner``).
OWNER = Rule(
    "extents is None or extents.owner is self._owner_ok", otherwise="self._check_owner(meta)"
)
#: The step's extents fit the cache: two integer comparisons with the sizes remembered.
EXTENTS_FIT = Rule(
    "extents is not None and last is not None and last[0] is cache "
    "and extents.max_slot < last[5] and extents.max_block < last[6]",
    otherwise="self._check_extents(meta, cache)",
)
#: The step's new keys and values (``validation.KV_RULES``).
STEP_KV = Rule(
    "kv_passes(spec, key, value, device, meta.batch.num_tokens)",
    otherwise="validation.KV.explain(spec, key, value, device, meta.batch.num_tokens)",
)


def _where_given(name: str, items: list[Rule | Let]) -> list[Rule | Let]:
    """``items`` for an argument that may be None (a rule holds, a fact is None, where it is)."""
    return [
        Let(r.name, f"None if {name} is None else ({r.value})")
        if isinstance(r, Let)
        else Rule(f"{name} is None or ({r.holds})", r.says, r.at, r.otherwise)
        for r in items
    ]


_STEP_CALL = validation.Rules(
    "self, cache, meta",
    [LAST, META_KIND, CACHE_REMEMBERED, SCALES_SEEN, *FACTS, OWNER, EXTENTS_FIT],
    _NAMES,
)
_FORWARD = validation.Rules(
    "self, query, key, value, cache, meta, output",
    [
        LAST,
        META_KIND,
        CACHE_REMEMBERED,
        SCALES_SEEN,
        BACKEND_CHECKS,
        *FACTS,
        OWNER,
        *validation.tensor_rules(
            "query",
            "query",
            [None, "spec.num_heads", "spec.head_size"],
            "spec.dtype",
            "device",
            dense_rows=True,
        ),
        Rule(
            "query_shape[0] >= meta.batch.num_actual_tokens",
            "query has {query_shape[0]} tokens, the batch has {meta.batch.num_actual_tokens}",
        ),
        Rule(
            "(key is None) == (value is None)", "key and value must both be given or both be None"
        ),
        *_where_given("key", [STEP_KV]),
        # The output is [num_tokens, num_heads, head_size_v]: the query's shape where values
        # are as wide as keys.
        Let(
            "out_shape",
            "query_shape if spec.head_size_v == spec.head_size "
            "else (query_shape[0], spec.num_heads, spec.head_size_v)",
        ),
        *_where_given(
            "output",
            validation.tensor_rules(
                "output", "output", [], "spec.dtype", "device", like="out_shape", dense_rows=True
            ),
        ),
        EXTENTS_FIT,
    ],
    _NAMES,
)
_WRITE_STEP = validation.Rules(
    "self, key, value, cache, slot_mapping, meta",
    [
        LAST,
        CACHE_REMEMBERED,
        SCALES_SEEN,
        META_KIND,
        BACKEND_CHECKS,
        *FACTS,
        OWNER,
        Rule(
            "slot_mapping is None or slot_mapping is meta.batch.slot_mapping "
            "or (extents is not None and slot_mapping is extents.given_slot_mapping) "
            "or same_view(slot_mapping, meta.batch.slot_mapping) "
            "or (extents is not None and extents.given_slot_mapping is not None "
            "and same_view(slot_mapping, extents.given_slot_mapping))",
            "slot_mapping is not meta.batch.slot_mapping: with meta=, leave slot_mapping out "
            "(or pass the step's own)",
        ),
        STEP_KV,
        EXTENTS_FIT,
    ],
    _NAMES,
)
_WRITE_OWN = validation.Rules(
    "self, key, value, cache, slot_mapping",
    [
        LAST,
        CACHE_REMEMBERED,
        SCALES_SEEN,
        Rule("slot_mapping is not None", "write_kv needs slot_mapping or meta="),
        *FACTS[:2],
        *validation.tensor_rules(
            "slot_mapping", "slot_mapping", [None], "validation.INT_DTYPES", "device"
        ),
        Rule(
            "kv_passes(spec, key, value, device, slot_mapping_shape[0])",
            otherwise="validation.KV.explain(spec, key, value, device, slot_mapping_shape[0])",
        ),
    ],
    _NAMES,
)


class AttentionImpl(abc.ABC):
    """One layer's attention: write the new keys/values, then attend over the cache.

    ``forward`` and ``write_kv`` are the core's (every check, the opt-in clip counting, zeroed
    padding rows); a backend's kernel work is ``compute`` (by default ``store_kv`` then
    ``attend``) and ``store_kv``."""

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
        #: The cache's per-tensor (fp8) scales by name, and what identified their values each
        #: time they were found finite and non-zero (``validation.tensor_scale_key``).
        self._tensor_scales = validation.tensor_scale_names(spec)
        self._scales_seen = validation.CheckedStates()
        #: Why ``forward(return_lse=True)`` is refused for this spec (None: it is served).
        self._lse_refusal = backend.capabilities.lse.refusal(spec)

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
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size_v]
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
        if meta is not None:
            if not self._usual_write(key, value, cache, slot_mapping, meta):
                _WRITE_STEP.explain(self, key, value, cache, slot_mapping, meta)
            if self.clip_counter is not None:
                self.count_clipped(key, value, meta.batch.slot_mapping, cache)
            self.store_kv(key, value, cache, meta.batch.slot_mapping, meta)
            return
        _WRITE_OWN.check(self, key, value, cache, slot_mapping)
        assert slot_mapping is not None
        validation.check_slot_values(slot_mapping, cache)
        if not slot_mapping.is_contiguous():  # kernels read slots through a raw pointer
            slot_mapping = slot_mapping.contiguous()
        if self.clip_counter is not None:
            self.count_clipped(key, value, slot_mapping, cache)
        self.store_kv(key, value, cache, slot_mapping)

    @overload
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,
        return_lse: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,
        return_lse: Literal[True],
        lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,
        return_lse: bool,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size]; None: nothing new
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        *,
        output: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size_v]
        return_lse: bool = False,
        lse: torch.Tensor | None = None,  # [num_tokens, num_heads] float32
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values (unless None), then attend for every query token
        (``compute``, after every check).

        Rows past ``num_actual_tokens`` (padding) come back as zeros.

        ``return_lse=True`` returns ``(out, lse)``: ``lse`` ``[num_tokens, num_heads]``
        float32, each query row's log-sum-exp of its scaled scores in the natural log (a
        declared sink's logit included), from the same kernel call (FlashInfer's
        ``run(..., return_lse=True)``, in its ``[tokens, heads]`` layout); ``.t()`` is vLLM's
        ``[heads, tokens]``. Rows past ``num_actual_tokens`` and rows that see no key are
        ``+inf`` (an empty part: ``merge_attn_states`` weighs it 0). ``lse`` is an output
        buffer for it (e.g. a captured graph's), else one is allocated. Refused with
        UnsupportedConfigurationError, before anything is written, where the backend does
        not declare it (``capabilities.lse``)."""
        out = self.check_forward(query, key, value, cache, meta, output)
        if return_lse or lse is not None:
            lse = self.check_lse(query, lse, return_lse)
        if key is not None and self.clip_counter is not None:
            assert value is not None
            self.count_clipped(key, value, meta.batch.slot_mapping, cache)
        n = meta.batch.num_actual_tokens
        if out.shape[0] > n:
            out[n:].zero_()
        if lse is None:
            self.compute(query, key, value, cache, meta, out)
            return out
        if lse.shape[0] > n:
            lse[n:].fill_(math.inf)
        self.compute(query, key, value, cache, meta, out, lse=lse)
        return out, lse

    def check_lse(
        self, query: torch.Tensor, lse: torch.Tensor | None, return_lse: bool
    ) -> torch.Tensor:
        """Check a request for the LSE (declared for this spec, the buffer's shape, dtype and
        device) before anything is written; return the buffer (allocated where not given)."""
        if not return_lse:
            raise InvalidInputError("lse= was given without return_lse=True")
        if self._lse_refusal is not None:
            raise UnsupportedConfigurationError(self.backend.name, [self._lse_refusal])
        shape = (query.shape[0], self.spec.num_heads)
        if lse is None:
            return torch.empty(shape, dtype=torch.float32, device=self.backend.device)
        if not isinstance(lse, torch.Tensor):
            raise InvalidInputError(f"lse must be a tensor, got {type(lse).__name__}")
        if tuple(lse.shape) != shape or lse.dtype != torch.float32:
            raise InvalidInputError(
                f"lse must be float32 [num_tokens={shape[0]}, num_heads={shape[1]}], got "
                f"{lse.dtype} {list(lse.shape)}"
            )
        if not validation.same_device(lse.device, self.backend.device):
            raise InvalidInputError(
                f"lse is on {lse.device}; this layer runs on {self.backend.device}"
            )
        return lse

    def count_clipped(
        self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, cache: PagedKVCache
    ) -> None:
        """Count, with the opt-in ``clip_counter`` (when set), the values of a checked write
        that the cache's static scales clip (device ops only). ``forward`` and ``write_kv``
        call it before the backend's kernels (``compute``, ``store_kv``)."""
        if self.clip_counter is None:
            return
        n = slots.shape[0]
        self.clip_counter.add(key[:n], value[:n], slots, cache)

    def _accept_cache(self, cache: object) -> None:
        """check_cache, then remember the cache (and the very tensors it held) with its sizes:
        a model calls every layer with its own cache, step after step (the rules compare the
        next call's cache with this, :data:`CACHE_REMEMBERED`)."""
        if not isinstance(cache, PagedKVCache):
            raise InvalidInputError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        caps = self.backend.capabilities
        validation.check_cache(
            self.spec,
            caps.kv_cache_layout,
            cache,
            self.backend.device,
            strided=caps.strided_kv_cache,
            packing=self.backend.kv_packing,
        )
        planes = (cache, cache.key, cache.value, cache.key_scale, cache.value_scale)
        self._checked_cache = (*planes, cache.num_slots, cache.num_blocks)

    def _check_scale_values(self, cache: PagedKVCache) -> None:
        """The cache's per-tensor scales are finite and non-zero (read on the host), then
        remembered: :data:`SCALES_SEEN` compares their storage and versions on later calls, so
        an engine's step reads nothing until it sets or replaces a scale."""
        key = validation.tensor_scale_key(cache, self._tensor_scales)
        validation.check_tensor_scale_values(cache, self._tensor_scales)
        self._scales_seen.add(key)

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
        """The step's slots and blocks (found by ``build``) fit this cache (what
        :data:`EXTENTS_FIT` does not find in O(1): it names what does not fit)."""
        extents = meta.extents
        if extents is None:
            raise InvalidInputError(
                f"meta ({type(meta).__name__}) was not made by metadata_builder().build(batch)"
            )
        validation.check_extents(extents, meta.batch, cache)

    def check_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        output: torch.Tensor | None,
    ) -> torch.Tensor:
        """Validate a forward call completely (nothing written yet); return the output buffer:
        the rules of :data:`_FORWARD` (the backend's ``check_call`` among them), in one pass
        where they hold. The core's: a backend adds its checks in ``check_call``."""
        if not self._usual_call(query, key, value, cache, meta, output):
            _FORWARD.explain(self, query, key, value, cache, meta, output)
        if output is not None:
            return output
        if self.spec.head_size_v == self.spec.head_size:
            return torch.empty_like(query)
        return query.new_empty((query.shape[0], self.spec.num_heads, self.spec.head_size_v))

    # --- the rules, read in one pass ----------------------------------------------------------
    # A model calls every layer with its own cache, step after step, with tensors of the spec's
    # shapes: these read every rule of a call in one compiled expression (no function per
    # tensor, no error text). Where one does not hold, the calls above read the same rules one
    # by one to name it (``Rules.explain``). tests/test_usual_call.py holds both readings to
    # the same outcomes.

    #: Whether every rule of a call with a step's metadata holds (its kind, cache, owner,
    #: extents), of ``check_forward``, and of ``write_kv(meta=)``: the tables' compiled
    #: functions themselves, bound as methods (no call in between).
    _usual_step = _STEP_CALL.passes
    _usual_call = _FORWARD.passes
    _usual_write = _WRITE_STEP.passes

    def _usual_kv(self, key: object, value: object, meta: AttentionMetadata) -> bool:
        """``validation.KV_RULES`` for the step's new keys and values."""
        return validation.KV.passes(
            self.spec, key, value, self.backend.device, meta.batch.num_tokens
        )

    def check_call(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        """Backend-specific checks of a call with a step's metadata (``forward`` and
        ``write_kv(meta=)``), before anything is written: e.g. that ``meta`` is this backend's
        own kind, or that the cache's storage suits its kernels. Raise InvalidInputError.
        Default: nothing beyond the shared checks."""
        return None

    # --- what a backend implements ---------------------------------------------------------
    def compute(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size], or None
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,  # [num_tokens, num_heads, head_size_v]: rows past the step zeroed
        lse: torch.Tensor | None = None,  # [num_tokens, num_heads] float32: rows past, +inf
    ) -> None:
        """A layer's kernel work of one step, after every check: write this step's keys and
        values (unless None) and attend for every query token into ``out``. Default: the
        composition ``store_kv`` then ``attend``; a kernel that writes and attends in one call
        (a fused decode) overrides this, never ``forward``.

        ``lse`` is passed only where the caller asked for the LSE and the backend declares it
        (``capabilities.lse``): a backend that declares none never sees the argument. Fill its
        rows of the step with each row's natural-log LSE (``+inf`` where a row sees no key)."""
        if key is not None:
            assert value is not None
            self.store_kv(key, value, cache, meta.batch.slot_mapping, meta)
        if lse is None:
            self.attend(query, key, value, cache, meta, out)
        else:
            self.attend(query, key, value, cache, meta, out, lse=lse)

    @abc.abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int, -1 = padding
        meta: AttentionMetadata | None = None,
    ) -> None:
        """Write keys/values (already validated) to the cache; skip slots < 0.

        With ``meta`` (a step's write: ``forward``, ``write_kv(meta=)``), ``slot_mapping`` is
        ``meta.batch.slot_mapping`` and the write may use what the builder planned for the step
        (e.g. slots already filtered of padding); without it, the slots are the caller's own."""

    @abc.abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Attention of every query token of ``meta.batch`` over the cache, into ``out``.

        ``key``/``value`` are this step's new tokens (already in the cache), or None; a backend
        may use them where that is cheaper than reading the cache back. ``lse``: as in
        :meth:`compute` (passed only where requested and declared).
        """


#: A backend without a planning hook of its own plans nothing (``AttentionMetadata``).
AttentionBackend.builder_type = AttentionMetadataBuilder
