"""BatchMetadata: what one engine step asks of attention (vLLM's ``CommonAttentionMetadata``).

Lengths, per request r (requests packed in batch order):
  query_len[r]   new tokens of r in this step (their q/k/v rows are packed, request by request)
  seq_len[r]     tokens of r in the KV cache once this step's keys are written
  context_len[r] = seq_len[r] - query_len[r]: tokens already cached before this step

A query token at position p (0-based within its sequence; new tokens take positions
context_len .. seq_len-1) sees keys 0..p when causal ("bottom-right" alignment), every key of its
sequence when not. Its key and value go to cache slot
``block_table[r, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from attnhub.errors import InvalidInputError


def _as_host_int_tensor(values: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    t = torch.as_tensor(values)
    if not isinstance(values, torch.Tensor) and t.numel() == 0:
        t = t.to(torch.int32)  # torch.as_tensor([]) is float32: an empty list holds no floats
    if t.dtype not in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        raise InvalidInputError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise InvalidInputError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to("cpu", torch.int32)


@dataclass
class BatchMetadata:
    """One step's batch, shared by every attention layer of the model.

    Device tensors are on the attention device; the ``*_cpu`` twins are host copies so that
    builders never read device memory. ``block_table_cpu`` / ``slot_mapping_cpu`` may be None
    when the batch lives on the CPU (the tensors themselves are then the host data); a batch on
    an accelerator carries them (engines have both on the host: ``from_lengths`` fills them), so
    that a step's value checks need no device-to-host copy.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: cumulative query lengths, from 0
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host
    seq_lens: torch.Tensor  # [num_reqs] int32
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, host
    num_reqs: int
    num_actual_tokens: int  # query_start_loc[-1]; rows past it (padding) are ignored
    max_query_len: int
    max_seq_len: int
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding (never written)
    block_size: int
    causal: bool = True
    block_table_cpu: torch.Tensor | None = None  # [num_reqs, max_blocks] int32, host
    slot_mapping_cpu: torch.Tensor | None = None  # [num_tokens] int64, host

    # --- construction ------------------------------------------------------------------
    @classmethod
    def from_lengths(
        cls,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        block_table: Sequence[Sequence[int]] | torch.Tensor,
        block_size: int,
        device: str | torch.device = "cpu",
        *,
        causal: bool = True,
        num_tokens: int | None = None,
    ) -> BatchMetadata:
        """Build a batch from per-request lengths and the block table.

        ``num_tokens`` (>= sum of query lengths) pads ``slot_mapping`` with -1, as engines do
        for graph-captured steps. Everything is validated; errors name the bad value.
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise InvalidInputError(f"block_size = {block_size!r} must be a positive int")
        q = _as_host_int_tensor(query_lens, "query_lens")
        s = _as_host_int_tensor(seq_lens, "seq_lens")
        if q.numel() != s.numel():
            raise InvalidInputError(
                f"query_lens has {q.numel()} requests but seq_lens has {s.numel()}"
            )
        if isinstance(block_table, torch.Tensor):
            table = block_table.to("cpu")
        elif len(block_table) == 0:
            table = torch.zeros((0, 1), dtype=torch.int32)
        else:
            width = max(len(row) for row in block_table)
            table = torch.zeros((len(block_table), max(width, 1)), dtype=torch.int32)
            for r, row in enumerate(block_table):
                table[r, : len(row)] = torch.as_tensor(list(row), dtype=torch.int32)
        from attnhub import validation

        validation.GIVEN_TABLE.check(table, q.numel())
        table = table.to(torch.int32)
        validation.check_given_lengths(q.numpy(), s.numpy(), table.numpy(), block_size)

        qsl = torch.zeros(q.numel() + 1, dtype=torch.int32)
        torch.cumsum(q, 0, out=qsl[1:])
        total = int(qsl[-1])
        slots = slot_mapping_from_positions(q, s, table, block_size)
        if num_tokens is not None:
            if num_tokens < total:
                raise InvalidInputError(
                    f"num_tokens = {num_tokens} is less than the {total} query tokens"
                )
            slots = torch.cat([slots, slots.new_full((num_tokens - total,), -1)])
        dev = torch.device(device)
        on_host = dev.type == "cpu"
        return cls(
            query_start_loc=qsl.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens=s.to(dev),
            seq_lens_cpu=s,
            num_reqs=q.numel(),
            num_actual_tokens=total,
            max_query_len=int(q.max()) if q.numel() else 0,
            max_seq_len=int(s.max()) if s.numel() else 0,
            block_table=table.to(dev),
            slot_mapping=slots.to(dev),
            block_size=block_size,
            causal=causal,
            block_table_cpu=None if on_host else table,
            slot_mapping_cpu=None if on_host else slots,
        )

    # --- derived (host) -----------------------------------------------------------------
    @property
    def query_lens_cpu(self) -> torch.Tensor:  # [num_reqs] int32
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:  # [num_reqs] int32
        return self.seq_lens_cpu - self.query_lens_cpu

    @property
    def num_tokens(self) -> int:
        """Rows of q/k/v this step carries, padding included (= len(slot_mapping))."""
        return int(self.slot_mapping.shape[0])

    @property
    def device(self) -> torch.device:
        return self.query_start_loc.device

    def host_block_table(self) -> torch.Tensor:  # [num_reqs, max_blocks] int, host
        """The block table as host data: ``block_table_cpu``, or the table itself on the CPU.
        Raises InvalidInputError for a batch on an accelerator without its host copy."""
        copy = self.block_table_cpu
        if copy is not None:
            return copy
        return self.block_table if self.block_table.is_cpu else self._host("block_table")

    def host_slot_mapping(self) -> torch.Tensor:  # [num_tokens] int, host
        """The slot mapping as host data (see :meth:`host_block_table`)."""
        copy = self.slot_mapping_cpu
        if copy is not None:
            return copy
        return self.slot_mapping if self.slot_mapping.is_cpu else self._host("slot_mapping")

    def _host(self, name: str) -> torch.Tensor:
        copy = getattr(self, name + "_cpu")
        if copy is not None:
            return copy
        t: torch.Tensor = getattr(self, name)
        if t.device.type != "cpu":
            raise InvalidInputError(
                f"this batch's {name} is on {t.device} and {name}_cpu (its host copy) is None: "
                "steps are planned from host data, never by reading device memory; pass the "
                "host copy (BatchMetadata.from_lengths does)"
            )
        return t

    def validate(self) -> None:
        """Check internal consistency using host copies only (``attnhub.validation``'s rules
        for a batch's structure and lengths). Raises InvalidInputError."""
        from attnhub import validation

        validation.check_batch(self)


def slot_mapping_from_positions(
    query_lens: torch.Tensor,  # [B] int, host
    seq_lens: torch.Tensor,  # [B] int, host
    block_table: torch.Tensor,  # [B, max_blocks] int, host
    block_size: int,
) -> torch.Tensor:  # [sum(query_lens)] int64: the cache slot of each new token
    """Slot of every new token: positions context_len..seq_len-1 of each request, packed."""
    q = query_lens.long()
    req = torch.repeat_interleave(torch.arange(q.numel()), q)
    starts = torch.cumsum(q, 0) - q
    offset_in_req = torch.arange(int(q.sum())) - starts[req]
    pos = (seq_lens.long() - q)[req] + offset_in_req
    blocks = block_table.long()[req, pos // block_size]
    return blocks * block_size + pos % block_size


def as_contiguous(t: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A batch tensor (lengths, offsets, table, slots) as kernels read it: contiguous, in
    ``dtype`` (a batch may hold int32 or int64). ``t`` itself when it already is, with no op
    dispatched: a plan calls this on every step, where the batch usually is already."""
    if t.dtype is dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


# --- helpers engines need around a batch ---------------------------------------------------


@dataclass(frozen=True)
class DecodePrefillSplit:
    """Counts for a batch whose decode requests come first (see :func:`reorder_decodes_first`)."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


def split_decodes_and_prefills(
    batch: BatchMetadata, decode_threshold: int = 1
) -> DecodePrefillSplit:
    """Split a decodes-first batch: a request is a decode when query_len <= decode_threshold.

    Raises InvalidInputError when a decode follows a prefill (reorder the batch first).
    """
    is_decode = batch.query_lens_cpu <= decode_threshold
    num_decodes = int(is_decode.sum())
    if bool(is_decode[num_decodes:].any()):
        r = num_decodes + int(is_decode[num_decodes:].nonzero()[0, 0])
        raise InvalidInputError(
            f"request {r} (query_len {int(batch.query_lens_cpu[r])}) is a decode after a "
            "prefill: reorder the batch with reorder_decodes_first()"
        )
    num_decode_tokens = int(batch.query_start_loc_cpu[num_decodes])
    return DecodePrefillSplit(
        num_decodes=num_decodes,
        num_prefills=batch.num_reqs - num_decodes,
        num_decode_tokens=num_decode_tokens,
        num_prefill_tokens=batch.num_actual_tokens - num_decode_tokens,
    )


@dataclass(frozen=True)
class BatchReorder:
    """How :func:`reorder_decodes_first` permuted a batch.

    ``request_order[i]`` is the old index of new request i; ``token_order[j]`` the old row of new
    token row j (padding rows keep their place at the end). Apply it to q/k/v with
    ``x[token_order]`` and undo it on the output with ``out[inverse_token_order]``.
    """

    request_order: torch.Tensor  # [num_reqs] int64, host
    token_order: torch.Tensor  # [num_tokens] int64, host

    @property
    def inverse_token_order(self) -> torch.Tensor:
        return torch.argsort(self.token_order)


def reorder_decodes_first(
    batch: BatchMetadata, decode_threshold: int = 1
) -> tuple[BatchMetadata, BatchReorder]:
    """Stable-reorder requests so that decodes (query_len <= threshold) come first."""
    qlens = batch.query_lens_cpu.long()
    is_prefill = (qlens > decode_threshold).long()
    order = torch.sort(is_prefill, stable=True).indices
    starts = batch.query_start_loc_cpu[:-1].long()
    rows = [torch.arange(int(starts[r]), int(starts[r] + qlens[r])) for r in order.tolist()]
    pad = torch.arange(batch.num_actual_tokens, batch.num_tokens)
    token_order = torch.cat([*rows, pad]) if rows else pad
    new_q = qlens[order]
    qsl = torch.zeros(batch.num_reqs + 1, dtype=torch.int32)
    torch.cumsum(new_q.int(), 0, out=qsl[1:])
    dev = batch.device
    seq = batch.seq_lens_cpu[order]
    table_cpu, slots_cpu = batch.block_table_cpu, batch.slot_mapping_cpu
    reordered = replace(
        batch,
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(dev),
        seq_lens_cpu=seq,
        block_table=batch.block_table[order.to(dev)],
        slot_mapping=batch.slot_mapping[token_order.to(dev)],
        block_table_cpu=None if table_cpu is None else table_cpu[order],
        slot_mapping_cpu=None if slots_cpu is None else slots_cpu[token_order],
    )
    return reordered, BatchReorder(request_order=order, token_order=token_order)


def make_local_attention_virtual_batches(
    batch: BatchMetadata, attn_chunk_size: int
) -> BatchMetadata:
    """Chunked local attention (Llama 4): a query at position p sees keys
    ``(p // attn_chunk_size) * attn_chunk_size .. p``.

    Each request becomes one virtual request per chunk its new tokens touch, with a block table
    that starts at that chunk, so any causal backend computes local attention unchanged. Token
    rows keep their order, so q/k/v and the slot mapping need no permutation.
    """
    chunk = attn_chunk_size
    bs = batch.block_size
    if chunk <= 0 or chunk % bs:
        raise InvalidInputError(
            f"attn_chunk_size = {chunk} must be a positive multiple of block_size = {bs}"
        )
    q = batch.query_lens_cpu.long()
    s = batch.seq_lens_cpu.long()
    ctx = s - q
    first = ctx // chunk  # first chunk touched by new tokens
    last = (s - 1) // chunk
    n_virtual = last - first + 1
    req = torch.repeat_interleave(torch.arange(batch.num_reqs), n_virtual)
    k = torch.arange(int(n_virtual.sum())) - torch.repeat_interleave(
        torch.cumsum(n_virtual, 0) - n_virtual, n_virtual
    )
    c = first[req] + k  # chunk index of each virtual request
    chunk_start = c * chunk
    q_start = torch.maximum(ctx[req], chunk_start)
    q_end = torch.minimum(s[req], chunk_start + chunk)
    v_query = (q_end - q_start).int()
    v_seq = (q_end - chunk_start).int()
    blocks_per_chunk = chunk // bs
    table_cpu = batch.host_block_table()
    cols = (chunk_start // bs)[:, None] + torch.arange(blocks_per_chunk)[None, :]
    valid = cols < table_cpu.shape[1]
    v_table = torch.where(
        valid, table_cpu[req[:, None], cols.clamp(max=table_cpu.shape[1] - 1)], 0
    ).to(torch.int32)
    qsl = torch.zeros(v_query.numel() + 1, dtype=torch.int32)
    torch.cumsum(v_query, 0, out=qsl[1:])
    dev = batch.device
    return BatchMetadata(
        query_start_loc=qsl.to(dev),
        query_start_loc_cpu=qsl,
        seq_lens=v_seq.to(dev),
        seq_lens_cpu=v_seq,
        num_reqs=v_query.numel(),
        num_actual_tokens=batch.num_actual_tokens,
        max_query_len=int(v_query.max()) if v_query.numel() else 0,
        max_seq_len=int(v_seq.max()) if v_seq.numel() else 0,
        block_table=v_table.to(dev),
        slot_mapping=batch.slot_mapping,
        block_size=bs,
        causal=batch.causal,
        block_table_cpu=None if dev.type == "cpu" else v_table,
        slot_mapping_cpu=batch.slot_mapping_cpu,
    )
