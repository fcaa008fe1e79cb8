"""The built-in ``torch`` backend: portable paged attention on any device PyTorch runs on.

Per step, the builder plans chunks of requests (``plan.py``); per layer, the impl gathers each
chunk's blocks with ``index_select`` into a reused buffer and makes one attention call
(``kernels.py``). The Python loop is over chunks, not tokens: measured on CPU, one SDPA call per
request (or per few decode requests) beats padding the whole batch to its longest request by 6x
for ragged batches (see docs/backends/torch.md).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Step,
    scratch_field,
)
from attnhub.batch import BatchMetadata
from attnhub.capabilities import (
    BatchInvariance,
    Capabilities,
    GraphSupport,
    HeadSizeVSupport,
    LseSupport,
    MlaSupport,
    Refusal,
    Tolerance,
)
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kv_cache import PagedKVCache
from attnhub.kv_write import flat_slots, write_slots
from attnhub.quant import indexable, quantize_fp8
from attnhub.spec import AttentionSpec, AttentionType
from attnhub.torch_backend import kernels
from attnhub.torch_backend.graph import GraphStep, graph_attend, graph_write
from attnhub.torch_backend.mla import TorchMLAImpl, TorchMLAMetadataBuilder
from attnhub.torch_backend.plan import Planner, SlotWrite, StepPlan, plan_slot_write


@dataclass(frozen=True)
class TorchAttentionMetadata(AttentionMetadata):
    plan: StepPlan | None = None
    #: (key, value) [max_gather_blocks, block_size, Hkv, D (values: Dv)] in the storage dtypes:
    #: scratch every layer of the step gathers into (the backend's, reused across steps).
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = scratch_field()
    #: Set by build_for_graph_capture: the step's fixed shape; forward takes the graph path.
    graph: GraphStep | None = None


@dataclass
class _WriteTarget:
    flat: torch.Tensor | None  # [num_slots, Hkv, D] view of the plane, where strides allow
    plane: torch.Tensor  # [num_blocks, block_size, Hkv, D] (fp8: its uint8 view)
    scale: torch.Tensor | None  # fp8 caches: the plane's scale
    dtype: torch.dtype  # the plane's storage dtype


class _Scratch(threading.local):
    """A backend's scratch tensors, per thread (``TorchBackend.buffer``)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.views: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}


class TorchMetadataBuilder(AttentionMetadataBuilder[TorchAttentionMetadata]):
    backend: TorchBackend
    #: Requests with query_len <= this are decodes, batched into decode chunks.
    reorder_batch_threshold: ClassVar[int] = 16
    metadata_type = TorchAttentionMetadata

    def __init__(self, backend: TorchBackend) -> None:
        super().__init__(backend)
        spec = self.spec
        k_dtype, v_dtype = spec.kv_cache_format.storage_dtypes(spec.dtype)
        self._storage_dtypes = (k_dtype, v_dtype)
        self._gather_budget_tokens = backend.gather_budget_bytes // (
            spec.num_kv_heads
            * (spec.head_size * k_dtype.itemsize + spec.head_size_v * v_dtype.itemsize)
        )
        self._planner = Planner(
            spec,
            decode_threshold=self.reorder_batch_threshold,
            # batch invariance: no decode chunk of several requests, so that each request is
            # one attention call of its own shapes, whatever else the step holds
            gather_budget_tokens=0 if spec.batch_invariant else self._gather_budget_tokens,
            eager=bool({"softcap", "alibi", "sinks"} & spec.features()),
            device=backend.device,
        )
        self._block_shape = (spec.block_size, spec.num_kv_heads)

    def plan(self, step: Step) -> Mapping[str, Any]:
        plan = self._planner.plan(step.batch, step.facts)
        n, spec = plan.max_gather_blocks, self.spec
        k_dtype, v_dtype = self._storage_dtypes
        buffers = (
            self.backend.buffer("key", (n, *self._block_shape, spec.head_size), k_dtype),
            self.backend.buffer("value", (n, *self._block_shape, spec.head_size_v), v_dtype),
        )
        return {"plan": plan, "gather_buffers": buffers}

    @property
    def graph_support(self) -> GraphSupport:
        """The declared level, but NEVER for a batch-invariant spec: its captured steps are
        refused (``build_for_graph_capture``), so a graph runner and vLLM (through the adapter)
        never plan a capture of it."""
        if self.spec.batch_invariant:
            return GraphSupport.NEVER
        return self.backend.capabilities.graph_capture

    def build_for_graph_capture(self, batch: BatchMetadata) -> TorchAttentionMetadata:
        """Metadata of the static-shape graph path (graph.py): no host planning at all; the
        batch's device tensors (the runner's persistent buffers) are read by forward.
        Refused for a batch-invariant spec: that path attends over the captured width's keys
        in one call over every request (a request's bits would follow the captured shape)."""
        if self.spec.batch_invariant:
            raise UnsupportedConfigurationError(
                self.backend.name,
                [
                    Refusal(
                        "batch_invariant: graph capture is not served: the captured path reads "
                        "every request over the batch's block-table width in one call over the "
                        "whole batch, so a request's bits would depend on the captured shape",
                        field="batch_invariant",
                        value="graph capture",
                    )
                ],
            )
        return self.metadata(self.capture_step(batch), {"graph": GraphStep.of(batch)})


class TorchAttentionImpl(AttentionImpl):
    backend: TorchBackend

    def __init__(
        self,
        backend: TorchBackend,
        *,
        alibi_slopes: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(backend, alibi_slopes=alibi_slopes, sinks=sinks)
        #: The last cache's key, value, key_scale, value_scale (compared by identity) and its
        #: write targets.
        self._targets: tuple[Any, Any, Any, Any, list[_WriteTarget]] | None = None
        self._eager = bool({"softcap", "alibi", "sinks"} & self.spec.features())
        self._invariant = self.spec.batch_invariant

    def check_call(self, cache: PagedKVCache, meta: AttentionMetadata) -> None:
        if not isinstance(meta, TorchAttentionMetadata) or (
            meta.gather_buffers is None and meta.graph is None
        ):
            raise InvalidInputError(
                f"meta must come from the torch backend's metadata_builder().build(batch), "
                f"got {type(meta).__name__}"
            )

    def store_kv(
        self,
        key: torch.Tensor,  # [num_tokens, Hkv, D]
        value: torch.Tensor,
        cache: PagedKVCache,
        slot_mapping: torch.Tensor,  # [n] int, -1 = padding
        meta: AttentionMetadata | None = None,
    ) -> None:
        if meta is None:
            self._scatter(key, value, cache, plan_slot_write(slot_mapping))
            return
        assert isinstance(meta, TorchAttentionMetadata)  # check_call
        if meta.graph is not None:
            graph_write(key, value, slot_mapping, self._write_targets(cache))
            return
        assert meta.plan is not None
        self._scatter(key, value, cache, meta.plan.write)

    def _write_targets(self, cache: PagedKVCache) -> list[_WriteTarget]:
        """Per plane: a flat [num_slots, Hkv, D] view to index_copy_ into (None where the
        plane's strides cannot merge blocks and slots), the plane, its fp8 scale. Remembered
        for the last cache's planes and scales (every step writes the same cache; an engine
        may attach scale tensors of its own to it between steps: those are then written with)."""
        memo = self._targets
        if (
            memo is not None
            and memo[0] is cache.key
            and memo[1] is cache.value
            and memo[2] is cache.key_scale
            and memo[3] is cache.value_scale
        ):
            return memo[4]
        targets = []
        for dst, scale in ((cache.key, cache.key_scale), (cache.value, cache.value_scale)):
            raw = indexable(dst)  # fp8: copy the bytes
            targets.append(
                _WriteTarget(flat=flat_slots(raw), plane=raw, scale=scale, dtype=dst.dtype)
            )
        self._targets = (cache.key, cache.value, cache.key_scale, cache.value_scale, targets)
        return targets

    def _scatter(
        self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, write: SlotWrite
    ) -> None:
        n = write.slots.shape[0]
        for src, target in zip((key, value), self._write_targets(cache), strict=True):
            src = src[:n] if write.rows is None else src[write.rows]
            if target.scale is not None:  # fp8: stored as fp8(x / scale)
                src = quantize_fp8(src, target.scale, target.dtype)
            write_slots(target.plane, target.flat, write.slots, indexable(src))

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        cache: PagedKVCache,
        meta: TorchAttentionMetadata,  # type: ignore[override]
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        spec, plan = self.spec, meta.plan
        if meta.graph is not None:
            graph_attend(
                spec, meta.graph, query, cache, meta.batch, self.alibi_slopes, self.sinks, out, lse
            )
            return
        assert plan is not None and meta.gather_buffers is not None  # check_call
        eager = self._eager or lse is not None  # SDPA returns no LSE: the eager pass does
        bs, Hkv = cache.block_size, spec.num_kv_heads
        k_buf, v_buf = meta.gather_buffers
        group = spec.num_heads // Hkv
        for chunk in plan.chunks:
            if lse is not None and not self._eager:  # planned for SDPA: read as the eager pass
                chunk = kernels.as_eager(chunk, group)
            C, n = chunk.num_reqs, chunk.num_reqs * chunk.num_blocks
            k = torch.index_select(cache.key, 0, chunk.block_ids, out=k_buf[:n])
            v = torch.index_select(cache.value, 0, chunk.block_ids, out=v_buf[:n])
            if chunk.pad_tokens is not None:  # rows past a shorter request's keys: zeros
                for gathered in (k, v):
                    rows_of = gathered.view(n * bs, Hkv, gathered.shape[3])
                    indexable(rows_of).index_fill_(0, chunk.pad_tokens, 0)
            # heads-first views of what was gathered, one op each: [C, Hkv, L, D] (values: Dv)
            k, v = (
                g.as_strided(
                    (C, Hkv, chunk.kv_len, d), (chunk.num_blocks * bs * Hkv * d, d, Hkv * d, 1)
                )
                for g, d in ((k, spec.head_size), (v, spec.head_size_v))
            )
            # fp8 cache: dequantize what was gathered, in float32 and rounded once to the model
            # dtype (a scale rounded to bf16 first would bias every key and value alike)
            if cache.key_scale is not None:
                k = (k.float() * cache.key_scale).to(spec.dtype)
            if cache.value_scale is not None:
                v = (v.float() * cache.value_scale).to(spec.dtype)
            rows = slice(chunk.first_token, chunk.first_token + C * chunk.query_len)
            q_rows = query[rows]
            if self._invariant:  # the request's rows at an address of their own (a kernel may
                q_rows = q_rows.clone()  # take another path for another alignment)
            if eager:
                kernels.attend_eager(
                    q_rows,
                    k,
                    v,
                    chunk,
                    spec.scale,
                    spec.logits_soft_cap,
                    self.alibi_slopes,
                    self.sinks,
                    out[rows],
                    None if lse is None else lse[rows],
                )
            else:
                kernels.attend_sdpa(q_rows, k, v, chunk, spec.scale, out[rows])


class TorchBackend(AttentionBackend):
    name = "torch"
    builder_type = TorchMetadataBuilder
    impl_type = TorchAttentionImpl
    capabilities = Capabilities(
        devices=None,  # any device torch runs on
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
        kv_cache_layout="NHD",
        attn_types=frozenset(AttentionType),
        sliding_window=True,
        softcap=True,
        alibi=True,
        sinks=True,
        multi_token_decode=True,
        chunked_prefill=True,
        # uniform batches (every request the same query length) take a static-shape path
        # (graph.py) whose per-step values are all read on the device
        graph_capture=GraphSupport.UNIFORM_BATCH,
        graph_capture_reason=(
            "uniform batches: the static-shape path (graph.py) lays a step out as R requests "
            "x Q query tokens, each request's keys gathered once for its Q rows; a mixed batch "
            "has no such grid (each token would gather its own request's W x block_size keys, "
            "T instead of R gathers)"
        ),
        tolerances={
            torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
            torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
            torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2),
        },
        priority={"cpu": 50},  # the portable default; vendor backends outrank it natively
        # every dtype, cache format and feature: its eager pass computes the row's max and
        # softmax denominator (a sink's term included) and returns m + log(denominator)
        lse=LseSupport(dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16})),
        # MLA's absorbed form (torch_backend/mla.py): float32 scores over the dequantized
        # latents, any query length (causal bottom-right), the LSE from the same pass
        mla=MlaSupport(
            dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
            kv_cache_dtypes=frozenset({"auto", "fp8_e4m3", "fp8_e5m2"}),
            layouts=("joint", "split"),
            lse=LseSupport(dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16})),
        ),
        # a batch-invariant spec plans one attention call per request (no decode chunk of
        # several, each padded to the longest): a request's call has its own shapes and
        # inputs whatever the step holds; the static-shape graph path is refused
        batch_invariant=BatchInvariance(
            dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
            reason="graph-captured steps are refused: their one call over the whole captured "
            "batch reads every request over the block table's width",
        ),
        # any value head size (MLA's expanded prefill: keys 192, values 128): every path
        # gathers and attends over each plane at its own width
        head_size_v=HeadSizeVSupport(pairs=None),
    )
    mla_builder_type = TorchMLAMetadataBuilder
    mla_impl_type = TorchMLAImpl

    #: Bytes of gathered K+V per decode chunk (one SDPA call each). Measured on CPU: a chunk
    #: that outgrows the CPU caches is slower than one call per request (docs/backends/torch.md).
    gather_budget_bytes = 4 << 20

    @classmethod
    def availability(cls, device: torch.device | str, emulate: bool = False) -> str | None:
        """Usable wherever torch can allocate on ``device`` (probed, not assumed)."""
        why = super().availability(device, emulate)
        if why is not None:
            return why
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError, ValueError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
            return f"torch cannot allocate on {str(device)!r}: {first_line}"
        return None

    def __init__(
        self, spec: AttentionSpec, device: torch.device | str = "cpu", *, emulate: bool = False
    ) -> None:
        super().__init__(spec, device, emulate=emulate)
        self._scratch = _Scratch()

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused scratch tensor of at least ``shape`` (grown, never shrunk; no page faults
        per call). Shared by every layer of this backend instance that runs in the calling
        thread: each thread has its own (steps planned in two threads at once, e.g. two models
        served through one backend, never gather into one buffer)."""
        scratch = self._scratch
        last = scratch.views.get(name)
        if last is not None and last[0] == shape and last[1].dtype == dtype:
            return last[1]  # the step before asked for the same: no tensor op at all
        numel = 1
        for n in shape:
            numel *= n
        buf = scratch.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            scratch.buffers[name] = buf
        view = buf[:numel].view(shape)
        scratch.views[name] = (shape, view)  # only the last: an old view would pin a grown-out one
        return view
