"""Decode context parallel (DCP) through a backend: one layer call over the rank's shard of the
KV cache, merged over the group by the LSEs.

    dcp = DecodeContextParallel(backend, group, world_size=N, interleave=I)  # once per model
    step = dcp.plan(batch)  # once per step, on every rank: checks, agreement, the shard's metadata
    out = dcp.forward(impl, step, query, key, value, cache)  # per layer: [T, Hl, D]

``backend`` is the rank's backend for its own layer spec (``Hl`` query heads, the group's
``K`` KV heads, replicated on every rank of the group as vLLM's DCP requires; block size ``B``,
the per-rank one); ``batch`` the step as the engine schedules it (whole requests, a table of
virtual blocks of ``N x B`` tokens); ``query`` the rank's heads ``[T, Hl, D]``, ``key`` and
``value`` the step's new tokens ``[T, K, D]``; ``cache`` the rank's shard.

How one layer runs (docs/context-parallel.md, "A DCP step"):

1. ``write_kv`` of the new tokens through the rank's slot mapping (another rank's token and a
   padding row: slot -1, not written); none where ``key`` and ``value`` are both None.
2. ``gather_heads``: the query of the group's ``N Hl`` heads (``B Hl`` where ranks share head
   blocks: ``ContextParallelGroup.head_owner``).
3. One ``forward(..., return_lse=True)`` of the backend over the rank's shard, for every head
   of the group, every query row as its own decode: the row of a request whose new token sits
   at global position ``p`` is a request of ``query_len`` 1 whose ``seq_len`` is the number of
   the rank's keys at positions ``<= p`` (``local_seq_lens(p + 1)``), sharing the request's
   block-table row. The one query token of a decode sees every key of its sequence, so the
   row sees exactly the rank's keys it attends to: those cached before the step and the new
   tokens up to itself. Causality among the new tokens is carried by the lengths, so the
   split into a context part and a causal part among the new tokens (vLLM's, merged by a
   second LSE merge) is not needed: every key a row attends to is on exactly one rank, and
   the merge over the group gives attention over all of them. It is the decode-only path
   (the whole shard, the new token included) for every row. In a step that is not causal
   (``batch.causal`` False) every row sees every key of its request: the rank's whole share.
4. ``combine``: the partials merged over the group for the rank's heads; the layer's sinks
   enter once, there (the backend runs without them).

Why every row is its own request: an attnhub step is causal with the query at the end of its
sequence, and a rank's share of a request's new tokens is not a suffix of its local sequence
(it holds only every ``N``-th run of them), so a multi-token request cannot keep its rows
together over a shard. Rows whose rank holds none of the keys they see get ``seq_len`` 1 (a
dummy key, the request's first slot) rather than being left out of the call: the call keeps
the step's rows in place (no gather or scatter of the query and output, one shape per step),
and the merge takes those rows as empty (``empty_rows``: their LSE is set to -inf and their
output is never read, so a NaN the dummy key gives cannot leak). The cost: a row reads its
context once per row (vLLM's GQA backends read it once per request, in a non-causal call), so
a long chunked prefill in a DCP step reads its context once per new token; and the step's
block table is copied once per row (host, once per step).

MLA layers (the absorbed form; docs/context-parallel.md, "MLA layers") take the same call:
``backend`` is the rank's backend for its :class:`~attnhub.mla.MLASpec` (``Hl`` heads), ``impl``
its ``MLAImpl``, ``query`` ``[T, Hl, kv_lora_rank + qk_rope_head_dim]`` (``[q_nope @ W_UK ;
q_pe]``), ``key`` and ``value`` the step's ``kv_c`` ``[T, kv_lora_rank]`` and ``k_pe`` ``[T,
qk_rope_head_dim]``, ``cache`` the rank's shard of the latent cache; the output is the latent
``[T, Hl, kv_lora_rank]`` (the engine applies ``W_UV``). The latent cache has no kv heads: every
rank holds the latents of its own tokens (the same sharding arithmetic), the query heads are
gathered as vLLM's MLA DCP does (``query_gather``: an all-gather over the group's heads), the
gathered MLA backend (``N Hl`` heads) makes the rank's call with ``return_lse``, and the partial
latent outputs merge by the LSEs (vLLM's ``cp_lse_ag_out_rs`` on the latent output, or the
all-to-all). It needs the declared MLA LSE (``Capabilities.mla.lse``); MLA has no window, ALiBi
or sinks.

Refused, with :class:`UnsupportedConfigurationError` naming the reason, on every rank before
any collective: a backend that does not declare the LSE for the spec (``Capabilities.lse``,
or ``Capabilities.mla.lse`` for an MLA layer: its reason), an impl that refuses the LSE beyond
the declaration (its reason), a sliding window or ALiBi (both need a key's global position; a
shard's kernel sees local positions), attention that is not causal decoder attention, and a
gathered spec (``N Hl`` heads) the backend refuses. Softcap is per score and needs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from attnhub.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
)
from attnhub.batch import BatchMetadata
from attnhub.capabilities import Refusal
from attnhub.context_parallel.communication import ContextParallelGroup
from attnhub.context_parallel.sharding import ContextShard, local_seq_lens
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.kv_cache import PagedKVCache
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.mla_backend import MLAImpl
from attnhub.spec import AttentionSpec, AttentionType


def dcp_unsupported_reasons(
    backend: type[AttentionBackend], spec: AttentionSpec | MLASpec
) -> list[Refusal]:
    """Why ``backend`` cannot serve decode context parallel for the rank's ``spec`` (empty:
    it can), whatever the group size. The gathered spec (more heads) is checked by
    :class:`DecodeContextParallel` itself. An MLA layer needs only the declared MLA LSE
    (``Capabilities.mla.lse``): it has no window, ALiBi or sinks, and is causal decoder
    attention."""
    reasons: list[Refusal] = []
    if isinstance(spec, MLASpec):
        mla_lse = backend.capabilities.mla.lse.refusal(spec)
        if mla_lse is not None:
            reasons.append(
                Refusal(f"decode context parallel of an MLA layer needs the LSE: "
                        f"{mla_lse.sentence}", field="mla.lse", value=mla_lse.value,
                        supported=mla_lse.supported)
            )  # fmt: skip
        return reasons
    # the kernel runs without the sinks (they enter once, in the merge): an LSE declared
    # without sinks serves
    lse = backend.capabilities.lse.refusal(replace(spec, use_sinks=False))
    if lse is not None:
        reasons.append(
            Refusal(f"decode context parallel needs the LSE: {lse.sentence}", field="lse",
                    value=lse.value, supported=lse.supported)
        )  # fmt: skip
    if spec.has_window:
        reasons.append(
            Refusal(
                f"decode context parallel: a sliding window ({spec.window}) needs each key's "
                "global position, and a rank's kernel sees its shard's local positions",
                field="sliding_window",
                value=spec.window,
            )
        )
    if spec.use_alibi:
        reasons.append(
            Refusal(
                "decode context parallel: ALiBi needs each key's global position (its distance "
                "to the query), and a rank's kernel sees its shard's local positions",
                field="alibi",
                value=True,
            )
        )
    if spec.attn_type is not AttentionType.DECODER:
        reasons.append(
            Refusal(
                f"decode context parallel serves causal decoder attention, not "
                f"{spec.attn_type.value}",
                field="attn_types",
                value=spec.attn_type,
            )
        )
    return reasons


@dataclass(frozen=True)
class DcpStep:
    """One step's plan on one rank, made by :meth:`DecodeContextParallel.plan` and read by
    every layer."""

    shard: ContextShard
    meta: AttentionMetadata  # the gathered backend's metadata: one decode per query row
    empty_rows: torch.Tensor  # [num_tokens] bool: rows that see no key of this rank (padding too)


class DecodeContextParallel:
    """The DCP layer call for one backend on one rank of ``group`` (see the module docstring).

    ``world_size`` is the configured group size (vLLM's ``decode_context_parallel_size``): a
    process group of another size is refused on every rank at the first step. Nothing is
    raised here: a refusal (the spec's, or the backend's of the gathered spec) is raised by
    :meth:`plan` on every rank, after the step's agreement, so that no rank is left waiting in
    a collective (:attr:`refusal` says it beforehand)."""

    def __init__(
        self,
        backend: AttentionBackend,
        group: ContextParallelGroup,
        *,
        world_size: int,
        interleave: int = 1,
    ) -> None:
        self.backend = backend
        self.group = group
        self.world_size = world_size
        self.interleave = interleave
        self.spec: AttentionSpec | MLASpec = backend.spec
        spec = self.spec
        #: Whether the layer is an MLA layer (its spec an MLASpec: the absorbed form).
        self.is_mla = isinstance(spec, MLASpec)
        reasons = dcp_unsupported_reasons(type(backend), spec)
        #: The backend serving the group's heads over the shard (no sinks: they enter once,
        #: in the merge); None where refused.
        self.gathered: AttentionBackend | None = None
        self._impl: Any = None  # the gathered backend's AttentionImpl or MLAImpl
        self._builder: AttentionMetadataBuilder[Any] | None = None
        n = group.world_size
        if not reasons:
            heads = group.head_blocks * spec.num_heads
            gathered_spec = (
                replace(spec, num_heads=heads)
                if isinstance(spec, MLASpec)
                else replace(spec, num_heads=heads, use_sinks=False)
            )
            reasons += [
                Refusal(f"decode context parallel over {n} ranks: the gathered spec "
                        f"({gathered_spec.num_heads} heads): {r.sentence}", field=r.field,
                        value=r.value, supported=r.supported)
                for r in type(backend).unsupported_reasons(gathered_spec)
            ]  # fmt: skip
            if not reasons:
                self.gathered = type(backend)(
                    gathered_spec, backend.device, emulate=backend.emulate
                )
                self._impl = self.gathered.impl()
                # an impl may refuse the LSE beyond the declaration (e.g. for its scale)
                why = getattr(self._impl, "_lse_refusal", None)
                if why is not None:
                    reasons.append(
                        Refusal(f"decode context parallel needs the LSE: {why.sentence}",
                                field=why.field, value=why.value, supported=why.supported)
                    )  # fmt: skip
                    self.gathered = self._impl = None
                else:
                    self._builder = self.gathered.metadata_builder()
        #: Why this backend cannot serve DCP for its spec (None: it can).
        self.refusal: UnsupportedConfigurationError | None = (
            UnsupportedConfigurationError(backend.name, reasons) if reasons else None
        )

    @property
    def query_width(self) -> int:
        """A query head's width: the head size (an MLA layer's: ``kv_lora_rank +
        qk_rope_head_dim``, the absorbed form's)."""
        spec = self.spec
        return spec.latent_size if isinstance(spec, MLASpec) else spec.head_size

    # --- once per step -----------------------------------------------------------------------
    def plan(self, batch: BatchMetadata) -> DcpStep:
        """This rank's plan of ``batch``: the checks, the step's agreement over the group (one
        fixed-size all-gather), the shard, and the gathered backend's metadata of the rank's
        decodes, its outcome settled over the group (one more: a build that fails on one
        rank, over its own lengths, fails on every rank). Raises on every rank (before any
        other collective) where a rank refuses."""
        shard = self.agree_and_shard(batch)
        builder = self._builder
        assert builder is not None

        def build() -> DcpStep:
            flat, empty = self.flat_step(batch, shard, batch.device)
            return DcpStep(shard, builder.build(flat), empty.to(batch.device))

        # the build reads the rank's own lengths: it may refuse on one rank only
        return self.group.settle(build, "the DCP step's metadata build")

    def agree_and_shard(
        self,
        batch: BatchMetadata,
        refusal: Exception | None = None,
        *,
        capture_sizes: Sequence[int] | None = None,
    ) -> ContextShard:
        """The step's agreement over the group and this rank's shard (host work and one
        fixed-size all-gather). ``refusal``: why the caller refuses the step on this rank
        (besides :attr:`refusal`), raised here after the agreement, the other ranks told.
        ``capture_sizes``: a graph runner's, part of what the ranks agree on."""
        return self.group.shard(
            batch, world_size=self.world_size, block_size=self.spec.block_size,
            interleave=self.interleave, refusal=self.refusal or refusal, spec=self.spec,
            capture_sizes=capture_sizes,
        )  # fmt: skip

    def flat_step(
        self, batch: BatchMetadata, shard: ContextShard, device: torch.device | str
    ) -> tuple[BatchMetadata, torch.Tensor]:
        """The rank's call over its shard as a batch of one-token requests, one per query row
        of ``batch`` (its padding rows stay rows, not requests), on ``device``; and the rows
        that see no key of this rank, ``[num_tokens]`` bool on the host (padding rows too)."""
        block_size = self.spec.block_size
        rows, lens = self._row_lengths(batch, shard)
        table = shard.block_table[torch.from_numpy(rows)] if rows.size else shard.block_table[:0]
        flat = BatchMetadata.from_lengths(
            torch.ones(rows.size, dtype=torch.int32), torch.from_numpy(np.maximum(lens, 1)),
            table, block_size, device,
            num_tokens=shard.num_tokens,
        )  # fmt: skip
        slots = shard.slot_mapping
        flat = replace(
            flat,
            slot_mapping=slots.to(device),
            slot_mapping_cpu=None if flat.slot_mapping_cpu is None else slots,
        )
        empty = torch.ones(shard.num_tokens, dtype=torch.bool)
        empty[: rows.size] = torch.from_numpy(lens == 0)
        return flat, empty

    def _row_lengths(self, batch: BatchMetadata, shard: ContextShard) -> tuple[np.ndarray, ...]:
        """Each query row's request and the rank's keys it sees (those at global positions up
        to the row's own; in a step that is not causal, ``batch.causal`` False, every key of
        its request: the last position's)."""
        qsl = batch.query_start_loc_cpu.numpy().astype(np.int64)
        qlens = qsl[1:] - qsl[:-1]
        seq = batch.seq_lens_cpu.numpy().astype(np.int64)
        rows = np.repeat(np.arange(batch.num_reqs), qlens)
        if batch.causal:
            position = np.repeat(seq - qlens - qsl[:-1], qlens) + np.arange(rows.size)
        else:
            position = np.repeat(seq - 1, qlens)
        lens = local_seq_lens(position + 1, shard.world_size, shard.rank, shard.interleave)
        return rows, lens

    # --- per layer -----------------------------------------------------------------------------
    def forward(
        self,
        impl: AttentionImpl | MLAImpl,
        step: DcpStep,
        query: torch.Tensor,  # [T, Hl, D]: this rank's heads (MLA: D = kv_lora_rank + rope)
        key: torch.Tensor | None,  # [T, K, D]: the step's new tokens (MLA: kv_c [T, R])
        value: torch.Tensor | None,  # [T, K, D] (MLA: k_pe [T, rope])
        cache: PagedKVCache | LatentKVCache,  # this rank's shard
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The layer's attention for this rank's heads, ``[T, Hl, D]`` in the query's dtype
        (an MLA layer's: the latent output ``[T, Hl, kv_lora_rank]``, which the engine
        multiplies by ``W_UV``; with ``return_lse``: and its LSE ``[T, Hl]`` float32, +inf
        where no key), equal to the single-rank attention of the whole step. ``impl`` is the
        rank's layer (its sinks, for its heads, are added once in the merge). ``key`` and
        ``value`` (an MLA layer's ``kv_c`` and ``k_pe``) both None: nothing new to write."""
        if impl.spec != self.spec:
            raise InvalidInputError(
                "impl was made for another spec than this DecodeContextParallel's backend"
            )
        blocks, hl, width = self.group.head_blocks, self.spec.num_heads, self.query_width
        if query.dim() != 3 or tuple(query.shape[1:]) != (hl, width):
            raise InvalidInputError(
                f"query must be [num_tokens, {hl}, {width}] (this rank's heads), "
                f"got {list(query.shape)}"
            )
        rows = int(step.empty_rows.shape[0])  # the step's rows, padding included
        if query.shape[0] != rows:  # else found only in the merge, after the write
            raise InvalidInputError(
                f"query has {query.shape[0]} rows, the step {rows} (its padding rows included)"
            )
        if (key is None) != (value is None):
            raise InvalidInputError(
                "key and value (an MLA layer's kv_c and k_pe): both given or both None"
            )
        assert self._impl is not None  # a refused backend never plans a step
        if key is not None:
            self._impl.write_kv(key, value, cache, meta=step.meta)
        gathered = self.group.gather_heads(query)
        out, lse = self._impl.forward(gathered, None, None, cache, step.meta, return_lse=True)
        merged, merged_lse = self.group.combine(
            out, lse.t(), sinks=getattr(impl, "sinks", None), empty_rows=step.empty_rows
        )
        assert merged.shape[1] == hl and blocks * hl == out.shape[1]
        result = merged.to(query.dtype)
        if return_lse:  # rows past the step: +inf, as forward's (a sink's term is no key)
            lse_rows = merged_lse.t().float().contiguous()
            lse_rows[step.meta.batch.num_actual_tokens :] = math.inf
            return result, lse_rows
        return result
