"""The collectives of a context-parallel step, over a ``torch.distributed`` process group.

Plain ``torch.distributed`` calls (``all_gather``, ``reduce_scatter``, ``all_to_all_single``)
on tensors of the group's device, so the same code runs on gloo (CPU), NCCL and HCCL.

A step, on every rank of the group:
  1. ``shard(batch, ...)`` (decode context parallel) or ``shard_prefill(batch, ...)``: one
     fixed-size all-gather of a fingerprint of the step (the layout each rank was given, its
     layer's spec, and a hash of its lengths and table), so ranks that disagree (other head
     counts included), or a group of the wrong size, raise a typed error on every rank,
     before any collective whose shape depends on the step could hang. Then the rank's
     :class:`ContextShard` (or :class:`PrefillShard`). Work after it whose outcome can differ
     between ranks (a backend's metadata build over the rank's own lengths) goes through
     ``settle``: one more fixed-size all-gather of whether it succeeded, so a failure on one
     rank is raised on every rank.
  2. per layer, ``gather_heads(query)``: the group's query heads, ``[T, B * Hl, D]``.
  3. per layer, ``combine(out, lse)``: the rank's partial over its shard, for all ``B * Hl``
     heads, merged over the group, returned for the rank's own ``Hl`` heads. Two ways:
     :class:`AllGatherReduceScatter` (gather the LSEs, scale the partial, reduce-scatter the
     heads: vLLM's ``cp_lse_ag_out_rs``) and :class:`AllToAll` (each rank receives every
     rank's partial of its heads, with the LSE packed in the same message, and merges them:
     vLLM's ``dcp_a2a_lse_reduce``). The partials travel in float32 (float64 if given).
     Under prefill context parallel, ``exchange(rows, shard)`` instead: every rank's rows (new
     keys and values, or outputs) back in the step's order.

Rank ``r``'s heads are ``r * Hl .. (r + 1) * Hl - 1`` of the gathered ones (vLLM's order), and
``B = N``; where several ranks hold the same heads (a DCP group spanning vLLM's PCP axis:
``grid``), ``head_owner[r]`` is rank ``r``'s head block and the group has ``B`` distinct ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist

from attnhub.batch import BatchMetadata
from attnhub.context_parallel.merge import (
    add_sinks,
    combine_partials,
    correct_partial,
    mask_empty_rows,
)
from attnhub.context_parallel.prefill import PrefillShard, shard_prefill
from attnhub.context_parallel.sharding import ContextShard, shard_step
from attnhub.errors import AttnhubError, InvalidInputError
from attnhub.mla import MLASpec
from attnhub.spec import AttentionSpec

#: What a rank is told about the group, as the step's fingerprint carries it ("kind": 0 for
#: decode context parallel, 1 for prefill; a field a kind does not use is 0).
LAYOUT_FIELDS = (
    "kind",
    "world_size",
    "block_size",
    "interleave",
    "decode_threshold",
    "head_owner",  # a hash
    "capture_sizes",  # a hash of a DcpGraphRunner's capture sizes (0: an eager step)
)
#: The layer's spec as the fingerprint carries it (``spec.<name>``): ranks whose layers differ
#: (other head counts, dtype, block size, window, softcap, ALiBi, sinks...) would send tensors
#: of other shapes or mean other things in the same collectives. Those in :data:`_SPEC_INTS` are
#: carried as they are, the others as a hash of their ``repr``; every field 0 where the caller
#: gives no spec. An MLA layer (:class:`attnhub.mla.MLASpec`) fills them as the absorbed form's
#: attention (:func:`spec_field_values`): one kv head, ``head_size`` the latent
#: (``kv_lora_rank + qk_rope_head_dim``), ``head_size_v`` ``kv_lora_rank``, ``attn_type``
#: ``"mla"``, and ``mla`` its own widths (None for standard attention).
SPEC_FIELDS = (
    "num_heads",
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "block_size",
    "dtype",
    "kv_cache_dtype",
    "scale",
    "attn_type",
    "window",
    "logits_soft_cap",
    "use_alibi",
    "use_sinks",
    "batch_invariant",
    "mla",  # an MLA layer's (qk_rope_head_dim, qk_nope_head_dim, v_head_dim); None otherwise
)
_SPEC_INTS = frozenset(
    ("num_heads", "num_kv_heads", "head_size", "head_size_v", "block_size", "use_alibi",
     "use_sinks", "batch_invariant")
)  # fmt: skip
_HASHED = frozenset(
    ("query_start_loc", "seq_lens", "block_table", "head_owner", "capture_sizes",
     *(f"spec.{f}" for f in SPEC_FIELDS if f not in _SPEC_INTS))
)  # fmt: skip
#: The fields of a step's fingerprint, in order (one int64 each).
FINGERPRINT_FIELDS = (
    "accepted",  # 1, or 0 where this rank refused its arguments (its own error says why)
    "group_size",
    *LAYOUT_FIELDS,
    *(f"spec.{f}" for f in SPEC_FIELDS),
    "batch.block_size",
    "num_reqs",
    "num_tokens",
    "query_start_loc",  # a hash of the values
    "seq_lens",  # a hash
    "block_table",  # a hash
    "causal",
)
#: How many bytes of a rank's error the others are told by :meth:`ContextParallelGroup.settle`.
MESSAGE_BYTES = 512
_UNREADABLE = -(2**62)
T = TypeVar("T")


def _int_or_sentinel(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        return _UNREADABLE
    return value


def _digest(t: torch.Tensor) -> int:
    """A 62-bit hash of a host integer tensor's values and shape."""
    a = np.ascontiguousarray(t.numpy().astype(np.int64))
    h = hashlib.blake2b(repr(a.shape).encode() + a.tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def _hash(value: object) -> int:
    """A 62-bit hash of ``repr(value)`` (the same in every process, unlike ``hash``)."""
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def spec_field_values(spec: AttentionSpec | MLASpec) -> dict[str, object]:
    """The :data:`SPEC_FIELDS` of a layer's spec, by name (an MLA layer's as the absorbed
    form's attention: see :data:`SPEC_FIELDS`)."""
    if isinstance(spec, MLASpec):
        return dict(
            num_heads=spec.num_heads, num_kv_heads=1, head_size=spec.latent_size,
            head_size_v=spec.kv_lora_rank, block_size=spec.block_size, dtype=spec.dtype,
            kv_cache_dtype=spec.kv_cache_dtype, scale=spec.scale, attn_type="mla", window=None,
            logits_soft_cap=None, use_alibi=False, use_sinks=False, batch_invariant=False,
            mla=(spec.qk_rope_head_dim, spec.qk_nope_head_dim, spec.v_head_dim),
        )  # fmt: skip
    values = {f: getattr(spec, f) for f in SPEC_FIELDS if f != "mla"}
    values["mla"] = None
    return values


def _spec_values(spec: object) -> list[int]:
    """:data:`SPEC_FIELDS` of ``spec`` (zeros for None). Raises InvalidInputError for what is
    neither an AttentionSpec nor an MLASpec."""
    if spec is None:
        return [0] * len(SPEC_FIELDS)
    if not isinstance(spec, (AttentionSpec, MLASpec)):
        raise InvalidInputError(
            f"spec must be an AttentionSpec or an MLASpec, got {type(spec).__name__}"
        )
    values = spec_field_values(spec)
    return [int(cast(int, values[f])) if f in _SPEC_INTS else _hash(values[f]) for f in SPEC_FIELDS]


def step_fingerprint(
    batch: object, group_size: int, spec: object = None, **layout: object
) -> list[int]:
    """The values of :data:`FINGERPRINT_FIELDS` for one rank's arguments (``spec``: the
    rank's layer, or None; ``layout``: the :data:`LAYOUT_FIELDS`). Never raises: what cannot
    be read gives ``accepted = 0``, so the rank still takes part in the gather."""
    return _fingerprint(batch, group_size, layout, spec=spec)[0]


def _fingerprint(
    batch: object,
    group_size: int,
    layout: Mapping[str, object],
    refusal: Exception | None = None,
    *,
    spec: object = None,
) -> tuple[list[int], Exception | None]:
    """The fingerprint, and why this rank refuses the step (``refusal``, or an argument that
    cannot be read), if it does."""
    head = [group_size, *(_int_or_sentinel(layout.get(f, 0)) for f in LAYOUT_FIELDS)]
    try:
        head += _spec_values(spec)
    except InvalidInputError as exc:
        head += [_UNREADABLE] * len(SPEC_FIELDS)
        refusal = refusal or exc
    try:
        if not isinstance(batch, BatchMetadata):
            raise InvalidInputError(f"batch must be a BatchMetadata, got {type(batch).__name__}")
        rest = [
            int(batch.block_size),
            int(batch.num_reqs),
            int(batch.num_tokens),
            _digest(batch.query_start_loc_cpu),
            _digest(batch.seq_lens_cpu),
            _digest(batch.host_block_table()),
            int(bool(batch.causal)),
        ]
    except Exception as exc:  # whatever it is, this rank refuses after the gather
        return [0, *head, *([_UNREADABLE] * 7)], exc
    return [0 if refusal else 1, *head, *rest], refusal


def _describe(field: str, values: list[int], spec: object = None) -> str:
    if field in _HASHED:
        groups: dict[int, list[int]] = {}
        for rank, v in enumerate(values):
            groups.setdefault(v, []).append(rank)
        sets = "; ".join(f"ranks {ranks}" for ranks in groups.values())
        own = ""
        if field.startswith("spec.") and isinstance(spec, (AttentionSpec, MLASpec)):
            own = f"; this rank's: {spec_field_values(spec)[field[5:]]!r}"
        return f"{field} differs between ranks (the same on {sets}{own})"
    shown = ", ".join(
        f"rank {rank}: {'unreadable' if v == _UNREADABLE else v}" for rank, v in enumerate(values)
    )
    return f"{field} differs between ranks ({shown})"


class ContextParallelGroup:
    """The collectives of a context-parallel step on ``group`` (None: the default group).

    ``device``: where the collectives' tensors live (the group's device: "cpu" for gloo, the
    rank's accelerator for NCCL or HCCL). ``check_group``: a group over the same ranks for the
    once-per-step fingerprint on host tensors (vLLM's ``cpu_group``, gloo); None checks on
    ``group`` with tensors on ``device``.

    ``head_owner``: each rank's query-head block, by group rank (None: rank ``r`` holds block
    ``r``, every rank its own heads). A DCP group that spans vLLM's PCP axis holds each
    tensor-parallel rank's heads ``PCP`` times (``attnhub.context_parallel.grid``): the group
    gathers and merges each of its ``B`` distinct blocks once, in block order. ``shard_rank``:
    which share of the KV cache this rank holds (None: its group rank); the engine's own rank
    in the group where it differs from torch's (vLLM's ``rank_in_group`` is the index in its
    group's rank list, torch's group rank the index in that list sorted).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        device: torch.device | str = "cpu",
        check_group: Any = None,
        head_owner: Sequence[int] | None = None,
        shard_rank: int | None = None,
    ) -> None:
        self.group = group
        self.device = torch.device(device)
        self.check_group = check_group
        self.world_size = n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        owner = tuple(range(n)) if head_owner is None else tuple(head_owner)
        blocks = sorted(set(owner))
        if (
            len(owner) != n
            or any(isinstance(b, bool) or not isinstance(b, int) for b in owner)
            or blocks != list(range(len(blocks)))
            or len({owner.count(b) for b in blocks}) != 1
        ):
            raise InvalidInputError(
                f"head_owner = {head_owner!r} must give each of the group's {n} ranks a head "
                "block 0..B-1, every block to as many ranks"
            )
        if shard_rank is None:
            shard_rank = self.rank
        if isinstance(shard_rank, bool) or not isinstance(shard_rank, int) or not (
            0 <= shard_rank < n
        ):  # fmt: skip
            raise InvalidInputError(f"shard_rank = {shard_rank!r} must be an int in 0..{n - 1}")
        #: Each rank's query-head block, by group rank; the number of blocks; this rank's.
        self.head_owner = owner
        self.head_blocks = len(blocks)
        self.head_block = owner[self.rank]
        #: The share of the KV cache this rank holds.
        self.shard_rank = shard_rank

    # --- once per step -------------------------------------------------------------------
    def agree(
        self, fingerprint: list[int], own_error: Exception | None = None, *, spec: object = None
    ) -> None:
        """One all-gather of ``fingerprint`` (of :data:`FINGERPRINT_FIELDS`' length) on every
        rank; raises InvalidInputError on every rank where a rank refused its step (that rank:
        ``own_error``, why it did) or the ranks' fingerprints differ (``spec``: this rank's
        layer, to name its value of a spec field that differs)."""
        if len(fingerprint) != len(FINGERPRINT_FIELDS):  # a programming error, same on all
            raise InvalidInputError(
                f"a fingerprint has {len(FINGERPRINT_FIELDS)} fields, got {len(fingerprint)}"
            )
        table = self._gather_host(torch.tensor(fingerprint, dtype=torch.int64))  # [N, fields]
        refused = [r for r, ok in enumerate(table[:, 0].tolist()) if not ok]
        if self.rank in refused:
            if isinstance(own_error, AttnhubError):  # its own type: e.g. a backend's refusal
                raise own_error
            raise InvalidInputError(f"this rank refused its step: {own_error!r}") from own_error
        if refused:
            raise InvalidInputError(
                f"rank(s) {refused} of the context-parallel group refused the step (their own "
                "error says why); this rank refuses it with them"
            )
        for i, field in enumerate(FINGERPRINT_FIELDS):
            column = table[:, i].tolist()
            if len(set(column)) > 1:
                raise InvalidInputError(
                    "the ranks of the context-parallel group were given different steps: "
                    + _describe(field, column, spec)
                )

    def settle(self, make: Callable[[], T], what: str) -> T:
        """``make()`` on this rank, then one fixed-size all-gather of whether it succeeded
        (with the first :data:`MESSAGE_BYTES` of its error) over the group: ``make()``'s
        result where it succeeded on every rank. Where it failed on any rank, raises on every
        rank, so that none is left waiting in the step's next collective: the failing rank
        its own error (an InvalidInputError around it if it is not attnhub's), the others an
        InvalidInputError naming each failing rank and its message. ``what``: the work, for
        the message. For work after the step's agreement whose outcome can differ between
        ranks (a backend's metadata build over the rank's own lengths)."""
        try:
            result: T | None = make()
            error: Exception | None = None
        except Exception as exc:  # every failure, whatever it is, is shared first
            result, error = None, exc
        said = b"" if error is None else f"{type(error).__name__}: {error}".encode()
        mine = torch.zeros(1 + MESSAGE_BYTES, dtype=torch.uint8)
        mine[0] = error is None
        said = said[:MESSAGE_BYTES]
        mine[1 : 1 + len(said)] = torch.tensor(list(said), dtype=torch.uint8)
        table = self._gather_host(mine)  # [N, 1 + MESSAGE_BYTES]
        failed = [r for r, ok in enumerate(table[:, 0].tolist()) if not ok]
        if error is not None:
            if isinstance(error, AttnhubError):
                raise error
            raise InvalidInputError(f"{what} failed on this rank: {error!r}") from error
        if failed:
            told = "; ".join(
                f"rank {r}: "
                + bytes(table[r, 1:].tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
                for r in failed
            )
            raise InvalidInputError(
                f"{what} failed on rank(s) {failed} of the context-parallel group ({told}); "
                "this rank stops the step with them"
            )
        return result  # type: ignore[return-value]  # make() returned on this rank

    def _gather_host(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``mine`` (a small host tensor), ``[N, ...]`` on the host: on the
        host ``check_group`` where there is one, else on ``group`` over ``device``."""
        group = self.check_group if self.check_group is not None else self.group
        device = torch.device("cpu") if self.check_group is not None else self.device
        mine = mine.to(device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=group)
        return torch.stack(every).cpu()

    def shard(
        self,
        batch: BatchMetadata,
        *,
        world_size: int,
        block_size: int,
        interleave: int = 1,
        refusal: Exception | None = None,
        spec: AttentionSpec | MLASpec | None = None,
        capture_sizes: Sequence[int] | None = None,
    ) -> ContextShard:
        """This rank's share of the step, once the ranks agree on it (see the module
        docstring). ``world_size`` is the group size the caller configured (vLLM's
        ``decode_context_parallel_size``): a group of another size is refused. Raises
        InvalidInputError on every rank, before any other collective. ``refusal``: why the
        caller refuses the step on this rank (e.g. the backend's
        UnsupportedConfigurationError), raised here after the agreement, the others told.
        ``spec``: the rank's layer (ranks whose layers differ are refused; None: not
        checked). ``capture_sizes``: a graph runner's capture sizes (ranks configured with
        others would pad the step to other row counts: refused; None: an eager step)."""
        sizes = 0 if capture_sizes is None else _hash(tuple(int(x) for x in capture_sizes))
        layout = dict(kind=0, world_size=world_size, block_size=block_size, interleave=interleave,
                      head_owner=_hash(self.head_owner), capture_sizes=sizes)  # fmt: skip
        shard, error = self._attempt(
            world_size,
            lambda: shard_step(
                batch, world_size=world_size, rank=self.shard_rank, block_size=block_size,
                interleave=interleave,
            ),
        )  # fmt: skip
        if error is None:
            error = refusal
        self.agree(*_fingerprint(batch, self.world_size, layout, error, spec=spec), spec=spec)
        assert isinstance(shard, ContextShard)
        return shard

    def shard_prefill(
        self,
        batch: BatchMetadata,
        *,
        world_size: int,
        decode_threshold: int = 1,
        refusal: Exception | None = None,
        spec: AttentionSpec | MLASpec | None = None,
    ) -> PrefillShard:
        """This rank's rows of a step under prefill context parallel, once the ranks agree on
        the step (as :meth:`shard`; ``refusal`` and ``spec`` likewise)."""
        layout = dict(kind=1, world_size=world_size, decode_threshold=decode_threshold,
                      head_owner=_hash(self.head_owner))  # fmt: skip
        shard, error = self._attempt(
            world_size,
            lambda: shard_prefill(
                batch, world_size=world_size, rank=self.rank, decode_threshold=decode_threshold
            ),
        )
        error = error or refusal
        self.agree(*_fingerprint(batch, self.world_size, layout, error, spec=spec), spec=spec)
        assert isinstance(shard, PrefillShard)
        return shard

    def _attempt(
        self, world_size: object, make: Callable[[], object]
    ) -> tuple[object, Exception | None]:
        """The rank's shard, or why it refuses the step: found before any collective, and
        told to the others by the fingerprint, so no rank is left waiting in one."""
        try:
            if world_size != self.world_size:
                raise InvalidInputError(
                    f"world_size = {world_size!r}, but the context-parallel process group has "
                    f"{self.world_size} ranks"
                )
            return make(), None
        except Exception as exc:  # every refusal, whatever it is, is shared first
            return None, exc

    # --- per layer -----------------------------------------------------------------------
    def exchange(self, rows: torch.Tensor, shard: PrefillShard) -> torch.Tensor:
        """Every rank's ``rows`` (``[local_tokens, ...]``, this rank's rows of the step under
        prefill context parallel: keys, values or outputs) in the step's order,
        ``[num_actual_tokens, ...]``: one all-gather of ``padded_tokens`` rows per rank."""
        if rows.shape[0] != shard.token_rows.shape[0]:
            raise InvalidInputError(
                f"rows has {rows.shape[0]} rows, this rank computes "
                f"{shard.token_rows.shape[0]} of the step"
            )
        sent = rows.new_zeros((shard.padded_tokens, *rows.shape[1:]))
        sent[: rows.shape[0]] = rows
        parts = [torch.empty_like(sent) for _ in range(self.world_size)]
        dist.all_gather(parts, sent, group=self.group)
        return torch.cat(parts)[shard.restore_rows.to(rows.device)]

    def gather_heads(self, query: torch.Tensor) -> torch.Tensor:  # [T, Hl, D] -> [T, B*Hl, D]
        """Every head block's query heads, block by block (by default every rank's, rank by
        rank)."""
        if self.head_blocks == 1:  # every rank holds the same heads
            return query
        parts = [torch.empty_like(query) for _ in range(self.world_size)]
        dist.all_gather(parts, query.contiguous(), group=self.group)
        first = [self.head_owner.index(b) for b in range(self.head_blocks)]
        return torch.cat([parts[r] for r in first], dim=1)

    def combine(
        self,
        out: torch.Tensor,  # [T, B * Hl, D]: this rank's partial over its shard
        lse: torch.Tensor,  # [B * Hl, T], natural log (+-inf: no key)
        *,
        sinks: torch.Tensor | None = None,  # [Hl]: this rank's heads' sink logits
        empty_rows: torch.Tensor | None = None,  # [T] bool: rows with no local key
    ) -> tuple[torch.Tensor, torch.Tensor]:  # merged [T, Hl, D], LSE [Hl, T]
        """The partials merged over the group, for this rank's heads (float32, or float64
        where given), with ``sinks`` entering once."""
        heads = self._check_partial(out, lse, sinks, empty_rows)
        if empty_rows is not None:
            lse = mask_empty_rows(lse, empty_rows)
        merged, merged_lse = self._merge(out, lse, heads // self.head_blocks)
        if sinks is not None:
            merged, merged_lse = add_sinks(merged, merged_lse, sinks)
        return merged, merged_lse

    def _merge(
        self, out: torch.Tensor, lse: torch.Tensor, local_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _check_partial(
        self,
        out: torch.Tensor,
        lse: torch.Tensor,
        sinks: torch.Tensor | None,
        empty_rows: torch.Tensor | None,
    ) -> int:
        """Shapes every rank can check alone (the same on every rank of an agreed step), so a
        bad call is refused on every rank before the collectives."""
        if out.dim() != 3 or lse.shape != (out.shape[1], out.shape[0]):
            raise InvalidInputError(
                f"a partial must be out [T, H, D] and lse [H, T], got out "
                f"{tuple(out.shape)} and lse {tuple(lse.shape)}"
            )
        heads, blocks = int(out.shape[1]), self.head_blocks
        if heads % blocks:
            raise InvalidInputError(
                f"{heads} query heads cannot be split into the group's {blocks} head blocks"
            )
        local = heads // blocks
        if sinks is not None and tuple(sinks.shape) != (local,):
            raise InvalidInputError(
                f"sinks must be [{local}] (this rank's heads: {heads} over {blocks} head "
                f"blocks), got shape {tuple(sinks.shape)}"
            )
        rows = int(out.shape[0])
        if empty_rows is not None and (
            tuple(empty_rows.shape) != (rows,) or empty_rows.dtype != torch.bool
        ):
            raise InvalidInputError(
                f"empty_rows must be a bool [{rows}] (one per row), got {empty_rows.dtype} "
                f"{tuple(empty_rows.shape)}"
            )
        return heads


def _wire_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for x in tensors:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


class AllGatherReduceScatter(ContextParallelGroup):
    """All-gather the LSEs ``[N, H, T]``, scale this rank's partial by ``exp(l_r - L)``,
    reduce-scatter (sum) over the heads (vLLM's ``cp_lse_ag_out_rs``)."""

    def _merge(
        self, out: torch.Tensor, lse: torch.Tensor, local_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wire = _wire_dtype(out, lse)
        mine = lse.to(wire).contiguous()
        lses = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(lses, mine, group=self.group)
        share, total = correct_partial(out.to(wire), torch.stack(lses), self.rank)
        blocks = [c.contiguous() for c in share.split(local_heads, dim=1)]
        chunks = [blocks[b] for b in self.head_owner]
        merged = torch.empty_like(blocks[self.head_block])
        dist.reduce_scatter(merged, chunks, op=dist.ReduceOp.SUM, group=self.group)
        heads = slice(self.head_block * local_heads, (self.head_block + 1) * local_heads)
        return merged, total[heads]


class AllToAll(ContextParallelGroup):
    """One all-to-all: rank ``r`` sends rank ``j`` its partial of ``j``'s heads with the LSE
    as one more element of each row ``[T, Hl, D + 1]``; every rank merges the ``N`` parts it
    receives (vLLM's ``dcp_a2a_lse_reduce``)."""

    def _merge(
        self, out: torch.Tensor, lse: torch.Tensor, local_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, _, d = out.shape
        b = self.head_blocks
        wire = _wire_dtype(out, lse)
        # [T, B, Hl, D] -> [B, T, Hl, D]; the LSE [B*Hl, T] -> [B, T, Hl, 1]
        parts = out.to(wire).reshape(t, b, local_heads, d).transpose(0, 1)
        lses = lse.to(wire).reshape(b, local_heads, t).transpose(1, 2)[..., None]
        blocks = torch.cat([parts, lses], dim=-1)  # [B, T, Hl, D + 1]
        owner = torch.tensor(self.head_owner, device=blocks.device)
        send = blocks[owner].contiguous()  # [N, T, Hl, D + 1]: rank j's block to rank j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        got_lse = recv[..., d].transpose(1, 2)  # [N, Hl, T]
        return combine_partials(recv[..., :d], got_lse)
