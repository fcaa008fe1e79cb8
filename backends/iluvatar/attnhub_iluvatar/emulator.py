"""A pure-PyTorch CPU emulator of exactly the ``ixformer`` ops ``attnhub_iluvatar`` calls.

On a machine without an Iluvatar CoreX GPU, ``ops.py`` hands the backend this module instead of
``ixformer``; the module exposes the ops under the attribute paths the real package has
(``emulator.contrib.vllm_flash_attn.flash_attn_varlen_func``,
``emulator.inference.functions.reshape_and_cache_flash``), so the backend's real translation
code runs on CPU. No public schema of ixformer exists: names, parameters and conventions come
from its public callers (``shared/vendor-ops.md``); ``[callers]`` and ``[inferred]`` mark how
sure each point is, and docs/backends/iluvatar.md lists them.

It is strict: where the vendor op would reject a call (a cache that is not HND, a block size
not a multiple of 16, an int64 length tensor, a scale plane of the wrong shape) it raises
:class:`IxformerOpError`; where the call is valid for the vendor but uses something not emulated
here (dropout, rotary embedding, ``sqrt_alibi``) it raises :class:`NotEmulatedError`. It
computes in float32 from its own reading of the conventions and never calls
``attnhub.reference`` (the conformance suite compares the two).

Emulated ops (the call forms of Iluvatar's vLLM fork, ``shared/callers/iluvatar-vllm-flash-
attention-backend.txt``, all accepted: ``tests/test_iluvatar_caller_forms.py`` replays them):
  contrib.vllm_flash_attn.flash_attn_varlen_func    varlen attention; paged with block_table
  contrib.vllm_flash_attn.flash_attn_with_kvcache   decode over the paged cache: q 4-D, tokens
                                                    through cu_query_lens / max_query_len
  contrib.vllm_flash_attn.merge_attn_states         merge two partial results (natural-log LSE)
  contrib.vllm_flash_attn.flash_attn_varlen_int8_func  modes 1 and 2: varlen attention over the
                                                    int8 cache (mode 2: 16-bit V, v_scale=None)
  inference.functions.reshape_and_cache_flash       KV write into the HND cache
  inference.functions.scaled_int8_quant_for_attn    symmetric int8 quantization (Q, K, V)
  inference.functions.reshape_and_cache_flash_int8  mode-1 KV write (int8 K/V, K scale per slot)
  inference.functions.reshape_and_cache_flash_mix   mode-2 KV write (int8 K, 16-bit V)
  inference.functions.vllm_paged_attention_int8     mode-1 paged decode attention
  inference.functions.vllm_paged_attention_mix      mode-2 paged decode attention
  (their fused ``save_*`` KV write included)

Conventions:
  - Paged cache: HND ``(num_blocks, num_kv_heads, block_size, head_size)``, block_size % 16 == 0,
    each plane contiguous; ``block_table`` int32 ``(B, max_blocks)`` with a contiguous last
    dimension (a column slice, as the caller's cascade suffix passes, is accepted) [callers].
  - Head sizes: multiples of 8 up to 256 (the caller's ``supports_head_size``) [callers].
  - Query rows past the last cumulative query end (CUDA-graph padding) are read by nothing and
    their output rows are left untouched [callers: the fork passes padded q / out].
  - Masks are bottom-right aligned: query i of a sequence with q_len Sq and kv_len Sk sees keys
    ``i + Sk - Sq - left .. i + Sk - Sq + right`` (``window_size=(left, right)``, -1 unbounded;
    causal forces right = 0) [callers: flash-attn's convention, which ixformer follows].
  - Score order: scale, softcap ``cap * tanh(s / cap)``, ALiBi ``-slope * |i + Sk - Sq - j|``,
    mask [callers]. Sinks (one logit per query head) join the softmax denominator and carry no
    value [inferred: the shared convention; the fork passes ``sinks=``].
  - LSE is the **natural log** of the softmax denominator, float32, shape (num_heads,
    num_tokens) [callers for the shape; the base from the fork's DCP path, which feeds it to
    vLLM's natural-log ``cp_lse_ag_out_rs``, and its cascade, which merges two of them]; a row
    that sees no key gives output 0 and LSE +inf [inferred]; rows past the last query end
    (graph padding) get NaN: nothing computes them [inferred].
  - ``merge_attn_states`` weighs the two parts by ``exp(lse)``; +inf LSE is an empty part; both
    empty gives 0 [inferred].
  - Slots < 0 are skipped by the cache writes [callers].
  - int8: symmetric, scale = amax / 127, q = clamp(round(x / scale), -128, 127), a zero scale
    stores zeros [callers, math inferred]; the kernels dequantize Q, K and V with their scales
    and compute as above. The paged kernels' ``save_*`` write each sequence's new tokens at the
    positions before context_lens (the last at context_lens - 1) before attending [inferred].
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from attnhub.kit import emulation, kernel_call, recording_tape
from attnhub.kit import merge_attn_states as kit_merge_attn_states

#: These ops stand in for the GPU: a host read made inside them is a read on the device, which
#: attnhub's host-sync guard (the conformance suite's) allows.
__attnhub_device_code__ = True

__all__ = [
    "Call",
    "IxformerOpError",
    "NotEmulatedError",
    "contrib",
    "inference",
    "record_calls",
]

MODEL_DTYPES = (torch.float16, torch.bfloat16)
#: Head sizes: the fork's ``supports_head_size``, ``head_size % 8 == 0 and head_size <= 256``.
HEAD_SIZE_ALIGN, MAX_HEAD_SIZE = 8, 256
BLOCK_ALIGN = 16


class IxformerOpError(RuntimeError):
    """The call is one ixformer rejects (its ops raise RuntimeError too)."""


class NotEmulatedError(NotImplementedError):
    """A valid ixformer call that uses something this emulator does not implement."""


# --- call recording (tests check what the backend passed) -----------------------------------------

_log = emulation.OpLog()
#: One emulated op call, as the caller made it (``name`` is the op's dotted path).
Call = emulation.Call
#: Collect every emulated op call made inside the block (name, args, kwargs).
record_calls = _log.record


#: Set while an op call is being captured into a graph (attnhub's eager tape): the decode
#: kernels check that such a launch is their capture-safe one (``use_cuda_graph=True``).
_capturing = False


def _launch(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
    """Every op call: inside a capture on attnhub's eager tape, one opaque tape entry (its
    host arguments frozen, its tensors read at every replay: a device kernel's launch)."""
    global _capturing
    if recording_tape() is None:
        return fn(*args, **kwargs)
    _capturing = True
    try:
        return kernel_call(name, fn, args, kwargs)
    finally:
        _capturing = False


def _capture_safe(op: str, use_cuda_graph: bool, max_context_len: int | None) -> None:
    """A decode kernel launched into a graph must be its capture-safe launch: the fork passes
    ``use_cuda_graph=True`` exactly on the decode-only steps it captures, with
    ``max_context_len`` sized for the graph [callers]; the eager launch sizes its work from
    the step's own lengths on the host, which a capture freezes [inferred: refused here]."""
    if _capturing and not use_cuda_graph:
        raise _fail(
            op,
            "launched inside a CUDA-graph capture with use_cuda_graph=False: the eager launch "
            "is not capture-safe (the fork passes use_cuda_graph=True on the steps it captures)",
        )
    if use_cuda_graph and max_context_len is None:
        raise _fail(op, "use_cuda_graph=True needs max_context_len (the graph's bound)")


def _op(path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the op ``path`` ("module.name"): recorded, bound like the vendor's,
    launched through ``_launch``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        op = _log.op(path, fn, binding=f"ixformer.{path}", route=_launch)
        op.__name__ = path.rsplit(".", 1)[1]
        return op

    return wrap


# --- argument checks ----------------------------------------------------------------------------


def _fail(op: str, message: str) -> IxformerOpError:
    return IxformerOpError(f"ixformer {op}: {message}")


def _not_emulated(op: str, what: str) -> NotEmulatedError:
    return NotEmulatedError(f"ixformer {op}: {what} is valid for the vendor op but not emulated")


def _tensor(op: str, name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise _fail(op, f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    return t


def _model_tensor(op: str, name: str, t: object, dims: int) -> torch.Tensor:
    t = _tensor(op, name, t, dims)
    if t.dtype not in MODEL_DTYPES:
        raise _fail(op, f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.stride(-1) != 1:
        raise _fail(op, f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return t


def _int32(op: str, name: str, t: object, dims: int) -> torch.Tensor:
    t = _tensor(op, name, t, dims)
    if t.dtype != torch.int32:
        raise _fail(op, f"{name} must be int32, got {t.dtype}")
    if not t.is_contiguous():
        raise _fail(op, f"{name} must be contiguous")
    return t


def _table(op: str, name: str, t: object) -> torch.Tensor:
    """A block table: int32 ``(B, max_blocks)`` whose last dimension is contiguous (rows may be
    strided: the fork's cascade passes ``block_table[:, n:]``) [callers]."""
    t = _tensor(op, name, t, 2)
    if t.dtype != torch.int32:
        raise _fail(op, f"{name} must be int32, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise _fail(op, f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return t


def _same_device(op: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise _fail(op, f"{name} is on {t.device}, the query on {ref.device}")


def _paged_cache(
    op: str, k_cache: object, v_cache: object, num_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HND planes ``(num_blocks, num_kv_heads, block_size, head_size)``, contiguous."""
    k = _tensor(op, "k_cache", k_cache, 4)
    v = _tensor(op, "v_cache", v_cache, 4)
    if k.shape != v.shape:
        raise _fail(op, f"k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} differ")
    _, num_kv_heads, block_size, d = k.shape
    if d != head_size:
        raise _fail(op, f"the cache's head_size {d} is not the query's {head_size}")
    if block_size % BLOCK_ALIGN:
        raise _fail(
            op,
            f"block_size {block_size} (dim 2 of the HND cache) is not a multiple of {BLOCK_ALIGN}",
        )
    if num_heads % num_kv_heads:
        raise _fail(op, f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise _fail(op, "k_cache and v_cache must be contiguous")
    return k, v


def _head_size(op: str, d: int) -> None:
    if d <= 0 or d % HEAD_SIZE_ALIGN or d > MAX_HEAD_SIZE:
        raise _fail(
            op, f"head_size {d} is not a multiple of {HEAD_SIZE_ALIGN} up to {MAX_HEAD_SIZE}"
        )


def _window(op: str, window_size: object) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in window_size)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise _fail(op, f"window_size must be a pair (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise _fail(op, f"window_size {window_size!r}: each side is -1 or >= 0")
    return left, right


def _cumulative(op: str, name: str, t: torch.Tensor, batch: int | None) -> list[int]:
    """Host values of a cumulative [B + 1] int32 tensor from 0, non-decreasing."""
    ends = [int(x) for x in t.tolist()]
    if batch is not None and len(ends) != batch + 1:
        raise _fail(op, f"{name} has {len(ends)} entries, expected batch + 1 = {batch + 1}")
    if not ends or ends[0] != 0 or any(b < a for a, b in itertools.pairwise(ends)):
        raise _fail(op, f"{name} must be cumulative from 0 (non-decreasing), got {ends}")
    return ends


def _alibi(op: str, slopes: object, num_heads: int) -> torch.Tensor | None:
    if slopes is None:
        return None
    s = _tensor(op, "alibi_slopes", slopes, 1)
    if s.dtype != torch.float32 or s.shape != (num_heads,):
        raise _fail(
            op,
            f"alibi_slopes must be float32 [num_heads={num_heads}], got {s.dtype} {list(s.shape)}",
        )
    return s


def _out(op: str, out: object, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    if out is None:
        return None
    o = _tensor(op, "out", out, like.dim())
    if o.shape != like.shape or o.dtype != dtype or o.device != like.device:
        raise _fail(
            op,
            f"out must be {dtype} {tuple(like.shape)} on {like.device}, got {o.dtype} "
            f"{tuple(o.shape)} on {o.device}",
        )
    return o


# --- the math ----------------------------------------------------------------------------------


def _attend(
    q: torch.Tensor,  # [Sq, H, D]
    k: torch.Tensor,  # [Sk, Hkv, D] (float32, dequantized)
    v: torch.Tensor,  # [Sk, Hkv, D]
    *,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    alibi: torch.Tensor | None,  # [H] float32
    sinks: torch.Tensor | None = None,  # [H] float32: one logit per head, no value
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Sq, H, D] float32, lse [H, Sq] float32 (ln)
    sq, h, d = q.shape
    sk, hkv, _ = k.shape
    group = h // hkv if hkv else 1
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q.float(), kk) * scale  # [H, Sq, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right alignment
    pos_k = torch.arange(sk)[None, :]
    if alibi is not None:
        s = s - alibi.float()[:, None, None] * (pos_q - pos_k).abs().float()
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= pos_k >= pos_q - left
    if right >= 0:
        keep &= pos_k <= pos_q + right
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:  # the sink joins the denominator as one more score, with no value
        sink = sinks.float()[:, None, None].expand(h, sq, 1)
        s = torch.cat([s, sink], dim=-1)
        vv = torch.cat([vv, vv.new_zeros(1, h, d)], dim=0)
    if s.shape[-1] == 0:  # no key at all: every row is empty
        return torch.zeros(sq, h, d), torch.full((h, sq), math.inf)
    m = s.amax(dim=-1, keepdim=True)  # [H, Sq, 1]
    empty = torch.isneginf(m)
    m = m.masked_fill(empty, 0.0)
    p = torch.exp(s - m)  # masked scores give exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    safe = denom.masked_fill(empty, 1.0)
    out = torch.einsum("hij,jhd->ihd", p / safe, vv)
    lse = (m + torch.log(safe)).squeeze(-1).masked_fill(empty.squeeze(-1), math.inf)
    return out, lse


def _check_blocks(op: str, cache: torch.Tensor, table_row: list[int], seq_len: int) -> None:
    """The blocks a sequence of ``seq_len`` keys reads from its table row exist in ``cache``
    (HND)."""
    num_blocks, _, bs, _ = cache.shape
    need = -(-seq_len // bs)
    if need > len(table_row):
        raise _fail(
            op, f"a sequence of {seq_len} keys needs {need} blocks, the table has {len(table_row)}"
        )
    bad = [b for b in table_row[:need] if not 0 <= b < num_blocks]
    if bad:
        raise _fail(op, f"block id {bad[0]} is outside the cache ({num_blocks} blocks)")


def _gather(
    cache: torch.Tensor,  # HND [num_blocks, Hkv, block_size, D]
    table_row: list[int],
    seq_len: int,
    op: str,
) -> torch.Tensor:  # [seq_len, Hkv, D]
    _, hkv, bs, d = cache.shape
    blocks = table_row[: -(-seq_len // bs)]  # checked by _check_blocks
    if not blocks:
        return cache.new_zeros((0, hkv, d))
    picked = cache[torch.tensor(blocks, dtype=torch.long, device=cache.device)]
    return picked.permute(0, 2, 1, 3).reshape(-1, hkv, d)[:seq_len]


@dataclass(frozen=True)
class _Dequant:
    """How to read a quantized cache: K int8 with a per-slot scale plane, V int8 with a per-
    channel scale (mode 1) or V in 16-bit (mode 2). None: the cache is in the model dtype."""

    key_scale_cache: torch.Tensor  # HND [num_blocks, Hkv, block_size] float32
    value_scale: torch.Tensor | None  # [Hkv, D] float32 (mode 1), None (mode 2)


def _read_sequence(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table_row: list[int],
    seq_len: int,
    op: str,
    dq: _Dequant | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [seq_len, Hkv, D] float32
    k = _gather(k_cache, table_row, seq_len, op).float()
    v = _gather(v_cache, table_row, seq_len, op).float()
    if dq is not None:
        ks = _gather(dq.key_scale_cache[..., None], table_row, seq_len, op)  # [S, Hkv, 1]
        k = k * ks
        if dq.value_scale is not None:
            v = v * dq.value_scale[None]
    return k, v


# --- flash_attn_varlen_func ----------------------------------------------------------------------


def _sinks(op: str, sinks: object, num_heads: int) -> torch.Tensor | None:
    """One sink logit per query head, float32 or the model dtype (the fork checks only
    ``sinks.shape[0] == num_heads``)."""
    if sinks is None:
        return None
    t = _tensor(op, "sinks", sinks, 1)
    if t.shape[0] != num_heads or not t.is_floating_point():
        raise _fail(
            op, f"sinks must be a float [num_heads={num_heads}], got {t.dtype} {list(t.shape)}"
        )
    return t


def _varlen(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None,
    causal: bool,
    window_size: object,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    block_table: torch.Tensor | None,
    q_scale: torch.Tensor | None = None,  # int8 Q: (H, T) float32, transposed [callers]
    dq: _Dequant | None = None,
    sinks: object = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:  # out [T, H, D] f32, lse [H, T], rows computed
    if q_scale is None:
        q = _model_tensor(op, "q", q, 3)
    h, d = q.shape[1:]
    _head_size(op, d)
    q_ends, k_ends, q_lens, k_lens = _varlen_lengths(
        op, q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table
    )
    window = _window(op, window_size)
    alibi = _alibi(op, alibi_slopes, h)
    sink = _sinks(op, sinks, h)
    _same_device(op, q, sinks=sink, alibi_slopes=alibi)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    k, v, table = _varlen_keys(op, q, k, v, block_table, k_ends[-1], len(q_ends) - 1, dq)
    for b, (q_len, k_len) in enumerate(zip(q_lens, k_lens, strict=True)):
        if block_table is not None:
            _check_blocks(op, k, table[b], k_len)
        if q_len > k_len and causal:
            raise _fail(op, f"sequence {b}: {q_len} queries over {k_len} keys (causal)")
    out32, lse = _varlen_math(
        op,
        q,
        k,
        v,
        q_ends,
        k_ends,
        table,
        scale,
        causal,
        window,
        float(softcap),
        alibi,
        q_scale,
        dq,
        sink,
    )
    return out32, lse, q_ends[-1]


def _varlen_lengths(
    op: str,
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_table: torch.Tensor | None,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The cumulative query and key ends and the lengths they make, checked against q's
    tokens and the max lengths."""
    t = q.shape[0]
    cu_q = _int32(op, "cu_seqlens_q", cu_seqlens_q, 1)
    cu_k = _int32(op, "cu_seqlens_k", cu_seqlens_k, 1)
    _same_device(op, q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=block_table)
    q_ends = _cumulative(op, "cu_seqlens_q", cu_q, None)
    batch = len(q_ends) - 1
    k_ends = _cumulative(op, "cu_seqlens_k", cu_k, batch)
    # rows past the last query end are CUDA-graph padding: the fork passes them [callers]
    if q_ends[-1] > t:
        raise _fail(op, f"cu_seqlens_q ends at {q_ends[-1]}, q has only {t} tokens")
    q_lens = [b - a for a, b in itertools.pairwise(q_ends)]
    k_lens = [b - a for a, b in itertools.pairwise(k_ends)]
    if batch and max(q_lens) > max_seqlen_q:
        raise _fail(op, f"max_seqlen_q = {max_seqlen_q} is below the longest query {max(q_lens)}")
    # Over the paged cache the fork passes max_seqlen_k = the step's max_query_len even for
    # sequences with cached context [callers]: the kernel reads each length from cu_seqlens_k.
    if batch and block_table is None and max(k_lens) > max_seqlen_k:
        raise _fail(
            op, f"max_seqlen_k = {max_seqlen_k} is below the longest packed key run {max(k_lens)}"
        )
    return q_ends, k_ends, q_lens, k_lens


def _varlen_keys(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_table: torch.Tensor | None,
    keys: int,
    batch: int,
    dq: _Dequant | None,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """The keys and values, packed [T_k, H_kv, D] (holding ``keys`` rows) or the paged cache
    with its block table's rows (one per sequence)."""
    h, d = q.shape[1:]
    if block_table is None:
        if dq is not None:
            raise _fail(op, "the int8 path takes a paged cache (block_table)")
        k = _model_tensor(op, "k", k, 3)
        v = _model_tensor(op, "v", v, 3)
        if k.shape != v.shape or k.shape[0] < keys or k.shape[2] != d:
            raise _fail(op, f"packed k/v {tuple(k.shape)} do not hold {keys} keys of {d}")
        if h % k.shape[1]:
            raise _fail(op, f"{h} query heads are not a multiple of {k.shape[1]} kv heads")
        return k, v, []
    k, v = _paged_cache(op, k, v, h, d)
    if dq is None and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise _fail(op, f"the cache ({k.dtype}) and q ({q.dtype}) must share a dtype")
    bt = _table(op, "block_table", block_table)
    if bt.shape[0] != batch:
        raise _fail(op, f"block_table has {bt.shape[0]} rows, the batch {batch} sequences")
    return k, v, bt.tolist()


def _varlen_null(
    op: str, q: torch.Tensor, *rest: Any
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D] float32, lse [H, T]
    t, h, d = q.shape
    return (
        emulation.preallocated((t, h, d), torch.float32, q.device),
        emulation.preallocated((h, t), torch.float32, q.device),
    )


@emulation.kernel(null=_varlen_null)
def _varlen_math(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ends: list[int],
    k_ends: list[int],
    table: list[list[int]],  # empty: packed k/v
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    alibi: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    dq: _Dequant | None,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, D] float32, lse [H, T] (ln)
    """``_varlen``'s math, every argument checked by it."""
    t, h, d = q.shape
    qf = q.float() if q_scale is None else q.float() * q_scale.t()[:, :, None]
    out = torch.zeros(t, h, d, dtype=torch.float32)
    lse = torch.full((h, t), math.inf, dtype=torch.float32)
    for b in range(len(q_ends) - 1):  # one sequence at a time
        if not table:
            kb, vb = k[k_ends[b] : k_ends[b + 1]], v[k_ends[b] : k_ends[b + 1]]
        else:
            kb, vb = _read_sequence(k, v, table[b], k_ends[b + 1] - k_ends[b], op, dq)
        o, lb = _attend(
            qf[q_ends[b] : q_ends[b + 1]],
            kb,
            vb,
            scale=scale,
            causal=causal,
            window=window,
            softcap=softcap,
            alibi=alibi,
            sinks=sinks,
        )
        out[q_ends[b] : q_ends[b + 1]] = o
        lse[:, q_ends[b] : q_ends[b + 1]] = lb
    # Rows past the last query end (graph padding) are computed by nothing: their LSE is
    # whatever the kernel's buffer held, NaN here so no caller can take it for an empty part
    # (+inf) [inferred]
    lse[:, q_ends[-1] :] = math.nan
    return out, lse


def _finish(
    op: str,
    out32: torch.Tensor,
    lse: torch.Tensor,
    out: object,
    like: torch.Tensor,
    dtype: torch.dtype,
    return_lse: bool,
    rows: int | None = None,
) -> Any:
    """The result in ``dtype`` shaped like ``like``, written into ``out`` when given: only its
    first ``rows`` rows (dim 0; the rest are graph padding, left untouched)."""
    target = _out(op, out, like, dtype)
    result = out32.to(dtype).view(like.shape)
    if target is None:
        target = result
    elif rows is None or rows == like.shape[0]:
        target.copy_(result)
    else:
        target[:rows].copy_(result[:rows])
    return (target, lse) if return_lse else target


@_op("contrib.vllm_flash_attn.flash_attn_varlen_func")
def flash_attn_varlen_func(
    q: torch.Tensor,  # [T, H, D] (rows past cu_seqlens_q[-1]: padding)
    k: torch.Tensor,  # packed [T_k, Hkv, D], or the HND cache with block_table
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, cumulative
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32, cumulative (also with the paged cache)
    max_seqlen_q: int,
    max_seqlen_k: int,  # over the paged cache, any positive bound (the fork: max_query_len)
    *,  # the order past here is not public: the fork passes every argument by keyword
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,  # [B, max_blocks] int32
    sqrt_alibi: bool = False,
    sinks: torch.Tensor | None = None,  # [H]: one sink logit per query head
    return_softmax_lse: bool = False,
    out: torch.Tensor | None = None,
) -> Any:  # out, or (out, lse [H, T] float32, natural log) with return_softmax_lse
    op = "flash_attn_varlen_func"
    if dropout_p:
        raise _not_emulated(op, f"dropout_p={dropout_p}")
    if return_attn_probs:
        raise _not_emulated(op, "return_attn_probs=True")
    if sqrt_alibi:
        raise _not_emulated(op, "sqrt_alibi=True (the vendor's formula is not public)")
    if sinks is not None and return_softmax_lse:
        raise _not_emulated(op, "return_softmax_lse with sinks (whether the LSE counts them)")
    out32, lse, rows = _varlen(
        op,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        block_table,
        sinks=sinks,
    )
    return _finish(op, out32, lse, out, q, q.dtype, return_softmax_lse, rows)


# --- flash_attn_with_kvcache ---------------------------------------------------------------------


@_op("contrib.vllm_flash_attn.flash_attn_with_kvcache")
def flash_attn_with_kvcache(
    q: torch.Tensor,  # [B, Sq, H, D]; with cu_query_lens [T, 1, H, D], one token a row
    k_cache: torch.Tensor,  # HND [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor,
    *,  # the order past here is not public: the fork passes every argument by keyword
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,  # [B] int32: keys per sequence
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,  # [B, max_blocks] int32
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    max_context_len: int | None = None,
    use_cuda_graph: bool = False,  # the capture-safe launch (_capture_safe); the same math
    use_sqrt_alibi: bool = False,
    sinks: torch.Tensor | None = None,  # [H]
    max_query_len: int | None = None,
    cu_query_lens: torch.Tensor | None = None,  # [B + 1] int32 over the rows of q
    out: torch.Tensor | None = None,
) -> Any:  # out, or (out, lse [H, T] float32, natural log) with return_softmax_lse
    op = "flash_attn_with_kvcache"
    _capture_safe(op, use_cuda_graph, max_context_len)
    for name, given in (
        ("k/v (appending new keys)", k is not None or v is not None),
        ("rotary_cos/rotary_sin", rotary_cos is not None or rotary_sin is not None),
        ("cache_batch_idx", cache_batch_idx is not None),
        ("cache_leftpad", cache_leftpad is not None),
        ("use_sqrt_alibi=True", use_sqrt_alibi),
        ("return_softmax_lse with sinks", return_softmax_lse and sinks is not None),
    ):
        if given:
            raise _not_emulated(op, name)
    if block_table is None:
        raise _not_emulated(op, "a cache without block_table")
    if cache_seqlens is None:
        raise _fail(op, "cache_seqlens is required")
    # q is 4-D as flash-attn documents it; every call of the fork passes (T, 1, H, D) with
    # cu_query_lens, whose entries count rows of q [callers]
    q4 = _model_tensor(op, "q", q, 4)
    batch, sq, h, d = q4.shape
    packed = q4.reshape(batch * sq, h, d)
    cu, longest_q = _query_ends(op, q4, cu_query_lens, max_query_len)
    cu_k, longest_k = _cache_ends(op, packed, cache_seqlens, cu, max_context_len)
    out32, lse, rows = _varlen(
        op,
        packed,
        k_cache,
        v_cache,
        cu,
        cu_k,
        longest_q,
        longest_k,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        block_table,
        sinks=sinks,
    )
    if sq != 1 and rows != batch * sq:
        raise _fail(op, f"cu_query_lens must cover every row of a q with {sq} tokens per row")
    return _finish(op, out32, lse, out, q, q.dtype, return_softmax_lse, rows if sq == 1 else None)


def _query_ends(
    op: str, q4: torch.Tensor, cu_query_lens: object, max_query_len: int | None
) -> tuple[torch.Tensor, int]:
    """The cumulative query ends over q's rows (``cu_query_lens``, or every row's Sq tokens)
    and the longest query."""
    batch, sq = q4.shape[:2]
    if cu_query_lens is None:
        cu = torch.arange(0, batch * sq + 1, sq, dtype=torch.int32, device=q4.device)
        return cu, sq
    if max_query_len is None:
        raise _fail(op, "cu_query_lens needs max_query_len")
    return _int32(op, "cu_query_lens", cu_query_lens, 1), int(max_query_len)


def _cache_ends(
    op: str,
    packed: torch.Tensor,
    cache_seqlens: object,
    cu: torch.Tensor,
    max_context_len: int | None,
) -> tuple[torch.Tensor, int]:
    """The cumulative key ends from ``cache_seqlens`` (keys per sequence), on q's device, and
    the longest sequence."""
    seqlens = _int32(op, "cache_seqlens", cache_seqlens, 1)
    _same_device(op, packed, cache_seqlens=seqlens, cu_query_lens=cu)
    lens = seqlens.tolist()
    if any(n < 0 for n in lens):
        raise _fail(op, f"cache_seqlens must be >= 0, got {lens}")
    if max_context_len is not None and lens and max(lens) > max_context_len:
        raise _fail(op, f"max_context_len {max_context_len} is below the longest {max(lens)}")
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(seqlens.to(torch.int64), 0)
    return cu_k.to(packed.device), max(lens, default=0)


# --- KV writes -----------------------------------------------------------------------------------


def _slots(op: str, slot_mapping: object, num_tokens: int, num_slots: int) -> list[int]:
    s = _tensor(op, "slot_mapping", slot_mapping, 1)
    if s.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"slot_mapping must be int32 or int64, got {s.dtype}")
    if s.shape[0] > num_tokens:
        raise _fail(op, f"slot_mapping has {s.shape[0]} entries for {num_tokens} tokens")
    slots = [int(x) for x in s.tolist()]
    over = [x for x in slots if x >= num_slots]
    if over:
        raise _fail(op, f"slot {over[0]} is outside the cache ({num_slots} slots)")
    return slots


@emulation.kernel(null=emulation.skip)
def _write_rows(
    cache: torch.Tensor,  # HND [num_blocks, Hkv, block_size, ...]
    rows: torch.Tensor,  # [n, Hkv, ...]
    slots: list[int],
) -> None:
    bs = cache.shape[2]
    for t, slot in enumerate(slots):
        if slot < 0:  # padding: skipped
            continue
        b, o = divmod(slot, bs)
        cache[b, :, o] = rows[t]


def _cache_pair(
    op: str, key: object, value: object, key_cache: object, value_cache: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    key_t = _model_tensor(op, "key", key, 3)
    value_t = _model_tensor(op, "value", value, 3)
    if key_t.shape != value_t.shape:
        raise _fail(op, f"key {tuple(key_t.shape)} and value {tuple(value_t.shape)} differ")
    kc = _tensor(op, "key_cache", key_cache, 4)
    vc = _tensor(op, "value_cache", value_cache, 4)
    _, hkv, bs, d = kc.shape
    if vc.shape != kc.shape:
        raise _fail(op, f"key_cache {tuple(kc.shape)} and value_cache {tuple(vc.shape)} differ")
    if (hkv, d) != tuple(key_t.shape[1:]):
        raise _fail(
            op,
            f"an HND cache of {hkv} kv heads x {d} does not take keys {tuple(key_t.shape)} "
            "(the cache must be (num_blocks, num_kv_heads, block_size, head_size))",
        )
    if bs % BLOCK_ALIGN:
        raise _fail(op, f"block_size {bs} is not a multiple of {BLOCK_ALIGN}")
    if not (kc.is_contiguous() and vc.is_contiguous()):
        raise _fail(op, "key_cache and value_cache must be contiguous")
    return key_t, value_t, kc, vc


@_op("inference.functions.reshape_and_cache_flash")
def reshape_and_cache_flash(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # HND [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [n <= T] int64 (or int32); < 0 skipped
    kv_cache_dtype: str,
    k_scale: float | torch.Tensor,
    v_scale: float | torch.Tensor,
) -> None:
    """Eight arguments, as the fork's ``vllm._custom_ops.reshape_and_cache_flash`` passes them
    (``kv_cache_dtype`` as vLLM's, the scales 1.0) [callers]; the scales matter only for fp8."""
    op = "reshape_and_cache_flash"
    key_t, value_t, kc, vc = _cache_pair(op, key, value, key_cache, value_cache)
    if kv_cache_dtype != "auto" and not (
        kv_cache_dtype == "bfloat16" and kc.dtype == torch.bfloat16
    ):
        raise _not_emulated(op, f"kv_cache_dtype={kv_cache_dtype!r}")
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(sc, torch.Tensor):
            if sc.numel() != 1:
                raise _fail(op, f"{name} must be one value, got shape {tuple(sc.shape)}")
        elif isinstance(sc, bool) or not isinstance(sc, (int, float)):
            raise _fail(op, f"{name} must be a number or a one-element tensor, got {sc!r}")
    if kc.dtype != key_t.dtype or vc.dtype != value_t.dtype:
        raise _fail(op, f"the cache ({kc.dtype}) and the keys ({key_t.dtype}) differ in dtype")
    slots = _slots(op, slot_mapping, key_t.shape[0], kc.shape[0] * kc.shape[2])
    _write_rows(kc, key_t, slots)
    _write_rows(vc, value_t, slots)


# --- merge_attn_states ---------------------------------------------------------------------------


@_op("contrib.vllm_flash_attn.merge_attn_states")
def merge_attn_states(
    prefix_output: torch.Tensor,  # [T, H, D]
    prefix_lse: torch.Tensor,  # [H, T] float32, natural log; +inf = empty
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output: torch.Tensor | None = None,  # [T, H, D], positional in the fork's calls [callers]
) -> torch.Tensor:
    op = "merge_attn_states"
    a = _model_tensor(op, "prefix_output", prefix_output, 3)
    b = _model_tensor(op, "suffix_output", suffix_output, 3)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise _fail(op, f"prefix_output {tuple(a.shape)} and suffix_output {tuple(b.shape)} differ")
    t, h, _ = a.shape
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        x = _tensor(op, name, lse, 2)
        if x.dtype != torch.float32 or x.shape != (h, t):
            raise _fail(op, f"{name} must be float32 [{h}, {t}], got {x.dtype} {list(x.shape)}")
    merged, lse = _merge_math(a, prefix_lse, b, suffix_lse)
    result: torch.Tensor = _finish(op, merged, lse, output, a, a.dtype, False)
    return result


def _merge_null(
    a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor, b_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # merged [T, H, D] float32, lse [H, T]
    t, h, d = a.shape
    return (
        emulation.preallocated((t, h, d), torch.float32, a.device),
        emulation.preallocated((h, t), torch.float32, a.device),
    )


#: ``merge_attn_states``' math (the kit's: natural log, an infinite LSE is an empty part),
#: every argument checked by the op.
_merge_math = emulation.kernel(null=_merge_null)(kit_merge_attn_states)


# --- int8 modes ----------------------------------------------------------------------------------
# Mode 1 ("int8"): int8 Q, K, V; K scale per (token, kv head) stored per slot in an HND
# (num_blocks, Hkv, block_size) float32 plane; V scale static per (kv head, channel) (Hkv, D).
# Mode 2 ("mix"): int8 Q and K (K scale as in mode 1); V in float16/bfloat16.
# Symmetric: scale = amax / 127, q = clamp(round(x / scale), -128, 127) [callers, math inferred].


@emulation.kernel(null=lambda x, scale: emulation.preallocated(x.shape, torch.int8, x.device))
def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x.float() / safe).clamp_(-128, 127).to(torch.int8)


@emulation.kernel(null=lambda x: emulation.preallocated(x.shape[:2], torch.float32, x.device))
def _token_scales(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, H] float32
    """A symmetric int8 scale per (token, head): amax / 127 over D."""
    return x.float().abs().amax(dim=2) / 127.0


@emulation.kernel(null=lambda x: emulation.preallocated(x.shape[1:], torch.float32, x.device))
def _channel_scales(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [H, D] float32
    """A symmetric int8 scale per (head, channel): amax / 127 over the tokens."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape[1:], dtype=torch.float32)
    return x.float().abs().amax(dim=0) / 127.0


@_op("inference.functions.scaled_int8_quant_for_attn")
def scaled_int8_quant_for_attn(
    x: torch.Tensor,  # [T, H, D] float16/bfloat16
    dim: int,
    transpose_scale: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # int8 like x, float32 scale
    """``dim`` is the dimension the scale reduces over [inferred from the shapes the fork's
    calls give and use]. ``dim=2``: a scale per (token, head), amax/127 over D, returned (T, H),
    or (H, T) with ``transpose_scale``. ``dim=0``: a scale per (head, channel) over the tokens,
    returned (H, D), or, with ``scale`` (H, D), quantize with that static scale, returned as
    given (the fork's mode-1 values, and its calibration call without a scale) [callers]."""
    op = "scaled_int8_quant_for_attn"
    x = _model_tensor(op, "x", x, 3)
    if dim == 2:
        if scale is not None:
            raise _not_emulated(op, "dim=2 with a given scale")
        s = _token_scales(x)  # [T, H]
        q = _quantize(x, s[..., None])
        return q, (s.t().contiguous() if transpose_scale else s)
    if dim == 0:
        if transpose_scale:
            raise _not_emulated(op, "dim=0 with transpose_scale=True")
        if scale is None:
            sc = _channel_scales(x)
        else:
            sc = _tensor(op, "scale", scale, 2)
            if sc.dtype != torch.float32 or tuple(sc.shape) != tuple(x.shape[1:]):
                raise _fail(
                    op,
                    f"a static scale for {tuple(x.shape)} must be float32 {tuple(x.shape[1:])}, "
                    f"got {sc.dtype} {tuple(sc.shape)}",
                )
        return _quantize(x, sc[None]), sc
    raise _fail(op, f"dim must be 2 (per token and head) or 0 (per channel), got {dim}")


def _int8(op: str, name: str, t: object, dims: int) -> torch.Tensor:
    t = _tensor(op, name, t, dims)
    if t.dtype != torch.int8:
        raise _fail(op, f"{name} must be int8, got {t.dtype}")
    if not t.is_contiguous():
        raise _fail(op, f"{name} must be contiguous")
    return t


def _f32(
    op: str, name: str, t: object, shape: tuple[int, ...], rows_strided: bool = False
) -> torch.Tensor:
    """A float32 tensor of ``shape``, contiguous; with ``rows_strided`` only its last dimension
    must be (the fork passes ``query_scale[:, n:]`` of an (H, T) scale) [callers]."""
    t = _tensor(op, name, t, len(shape))
    if t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise _fail(op, f"{name} must be float32 {shape}, got {t.dtype} {tuple(t.shape)}")
    dense = t.stride(-1) == 1 or t.shape[-1] <= 1 if rows_strided else t.is_contiguous()
    if not dense:
        raise _fail(op, f"{name} must be contiguous, got strides {t.stride()}")
    return t


def _quant_cache(
    op: str, key_cache: object, value_cache: object, key_scale_cache: object, mix: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mode 1: int8 K and V planes; mode 2 (``mix``): int8 K, 16-bit V; both HND and
    contiguous, with the (num_blocks, Hkv, block_size) float32 K-scale plane."""
    kc = _int8(op, "key_cache", key_cache, 4)
    nb, hkv, bs, _ = kc.shape
    vc = _tensor(op, "value_cache", value_cache, 4)
    if tuple(vc.shape) != tuple(kc.shape) or not vc.is_contiguous():
        raise _fail(op, f"value_cache must be contiguous {tuple(kc.shape)} (HND)")
    if mix and vc.dtype not in MODEL_DTYPES:
        raise _fail(op, f"value_cache must be float16 or bfloat16 (mode 2), got {vc.dtype}")
    if not mix and vc.dtype != torch.int8:
        raise _fail(op, f"value_cache must be int8 (mode 1), got {vc.dtype}")
    if bs % BLOCK_ALIGN:
        raise _fail(op, f"block_size {bs} is not a multiple of {BLOCK_ALIGN}")
    ks = _f32(op, "key_scale_cache", key_scale_cache, (nb, hkv, bs))
    return kc, vc, ks


def _write_quantized(
    op: str,
    key: object,
    value: object,
    k_scale: object,
    key_cache: object,
    value_cache: object,
    key_scale_cache: object,
    slot_mapping: object,
    kv_cache_dtype: object,
    mix: bool,
) -> None:
    if kv_cache_dtype != "":  # the fork passes "" [callers]; other values are not known
        raise _not_emulated(op, f"kv_cache_dtype={kv_cache_dtype!r} (the fork passes '')")
    kc, vc, ks_cache = _quant_cache(op, key_cache, value_cache, key_scale_cache, mix)
    key_t = _int8(op, "key", key, 3)
    value_t = _tensor(op, "value", value, 3)
    t, hkv, d = key_t.shape
    if tuple(value_t.shape) != (t, hkv, d) or value_t.dtype != vc.dtype:
        raise _fail(
            op,
            f"value must be {vc.dtype} {(t, hkv, d)}, got {value_t.dtype} {tuple(value_t.shape)}",
        )
    if value_t.stride(-1) != 1:
        raise _fail(op, f"value must have a contiguous last dimension, got {value_t.stride()}")
    if (hkv, d) != (kc.shape[1], kc.shape[3]):
        raise _fail(
            op,
            f"an HND cache of {kc.shape[1]} kv heads x {kc.shape[3]} does not take keys "
            f"{tuple(key_t.shape)}",
        )
    ks = _f32(op, "k_scale", k_scale, (t, hkv))
    slots = _slots(op, slot_mapping, t, kc.shape[0] * kc.shape[2])
    _write_rows(kc, key_t, slots)
    _write_rows(vc, value_t, slots)
    _write_rows(ks_cache[..., None], ks[..., None], slots)


@_op("inference.functions.reshape_and_cache_flash_int8")
def reshape_and_cache_flash_int8(
    *,  # the fork passes every argument by keyword; the order is not public
    key: torch.Tensor,  # [T, Hkv, D] int8
    value: torch.Tensor,  # [T, Hkv, D] int8 (quantized with the static V scale)
    k_scale: torch.Tensor,  # [T, Hkv] float32: each token's K scale
    key_cache: torch.Tensor,  # HND int8
    value_cache: torch.Tensor,  # HND int8
    key_scale_cache: torch.Tensor,  # [num_blocks, Hkv, block_size] float32
    slot_mapping: torch.Tensor,  # [n <= T] int; < 0 skipped
    kv_cache_dtype: str,  # "" [callers]
) -> None:
    _write_quantized(
        "reshape_and_cache_flash_int8",
        key,
        value,
        k_scale,
        key_cache,
        value_cache,
        key_scale_cache,
        slot_mapping,
        kv_cache_dtype,
        mix=False,
    )


@_op("inference.functions.reshape_and_cache_flash_mix")
def reshape_and_cache_flash_mix(
    *,
    key: torch.Tensor,  # [T, Hkv, D] int8
    value: torch.Tensor,  # [T, Hkv, D] float16/bfloat16
    k_scale: torch.Tensor,  # [T, Hkv] float32
    key_cache: torch.Tensor,  # HND int8
    value_cache: torch.Tensor,  # HND float16/bfloat16 (the packed storage's planes 1-2)
    key_scale_cache: torch.Tensor,  # [num_blocks, Hkv, block_size] float32
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,  # "" [callers]
) -> None:
    _write_quantized(
        "reshape_and_cache_flash_mix",
        key,
        value,
        k_scale,
        key_cache,
        value_cache,
        key_scale_cache,
        slot_mapping,
        kv_cache_dtype,
        mix=True,
    )


@_op("contrib.vllm_flash_attn.flash_attn_varlen_int8_func")
def flash_attn_varlen_int8_func(
    *,  # the fork passes every argument by keyword; the order is not public
    q: torch.Tensor,  # [T, H, D] int8 (rows past cu_seqlens_q[-1]: padding)
    k: torch.Tensor,  # HND int8 key cache
    v: torch.Tensor,  # HND value cache: int8 (mode 1) or float16/bfloat16 (mode 2)
    q_scale: torch.Tensor,  # [H, T] float32 (transposed; rows may be strided) [callers]
    k_scale: torch.Tensor,  # [num_blocks, Hkv, block_size] float32
    v_scale: torch.Tensor | None,  # [Hkv, D] float32 (mode 1); None (mode 2) [callers]
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    sqrt_alibi: bool = False,
    out: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:  # [T, H, D] in output_dtype
    op = "flash_attn_varlen_int8_func"
    if sqrt_alibi:
        raise _not_emulated(op, "sqrt_alibi=True (the vendor's formula is not public)")
    if block_table is None:
        raise _not_emulated(op, "packed (non-paged) int8 K/V")
    if output_dtype not in MODEL_DTYPES:
        raise _fail(op, f"output_dtype must be float16 or bfloat16, got {output_dtype}")
    qi = _int8(op, "q", q, 3)
    t, h, d = qi.shape
    qs = _f32(op, "q_scale", q_scale, (h, t), rows_strided=True)
    mix = v_scale is None  # mode 2: the 16-bit value cache, no value scale [callers]
    kc, vc, ks = _quant_cache(op, k, v, k_scale, mix=mix)
    vs = None if mix else _f32(op, "v_scale", v_scale, (kc.shape[1], d))
    out32, _, rows = _varlen(
        op,
        qi,
        kc,
        vc,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        block_table,
        q_scale=qs,
        dq=_Dequant(ks, vs),
    )
    result: torch.Tensor = _finish(op, out32, out32, out, qi, output_dtype, False, rows)
    return result


def _paged_decode(
    op: str,
    output: object,
    query: object,
    query_scale: object,
    kc: torch.Tensor,
    vc: torch.Tensor,
    dq: _Dequant,
    num_kv_heads: int,
    scale: float,
    block_tables: object,
    context_lens: object,
    block_size: int,
    max_context_len: int,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    use_sqrt_alibi: bool,
    cu_query_lens: object,
    max_query_len: int | None,
    saves: tuple[object, object, object],
) -> None:
    """Each sequence's queries (rows ``cu_query_lens[r]..cu_query_lens[r + 1]``, or one row
    each without it) over its context_lens keys, bottom-right aligned (the last query is the
    last key's position). With ``save_*``, each sequence's new keys/values/key scales (one per
    query row) are first written at the positions before context_lens (the fused KV write of
    decode-only steps) [inferred]."""
    if use_sqrt_alibi:
        raise _not_emulated(op, "use_sqrt_alibi=True (the vendor's formula is not public)")
    qi, qs = _decode_query(op, query, query_scale, kc, num_kv_heads, block_size)
    t, h, d = qi.shape
    bt = _table(op, "block_tables", block_tables)
    ends, lens = _decode_rows(
        op, qi, bt, context_lens, cu_query_lens, max_query_len, max_context_len
    )
    o = _tensor(op, "output", output, 3)
    if tuple(o.shape) != (t, h, d) or o.dtype not in MODEL_DTYPES:
        raise _fail(op, f"output must be float16/bfloat16 {(t, h, d)}, got {o.dtype}")
    alibi = _alibi(op, alibi_slopes, h)
    table = bt.tolist()
    save = (
        None
        if all(x is None for x in saves)
        else _decode_saves(op, saves, kc, vc, table, ends, lens)
    )
    for r in range(len(table)):  # every sequence's blocks, before anything is written
        _check_blocks(op, kc, table[r], lens[r])
    if save is not None:
        sk, sv, ss, slots = save
        _write_rows(kc, sk, slots)
        _write_rows(vc, sv, slots)
        _write_rows(dq.key_scale_cache[..., None], ss[..., None], slots)
    _paged_decode_math(
        op,
        o,
        qi,
        qs,
        kc,
        vc,
        dq,
        table,
        lens,
        ends,
        float(scale),
        causal,
        window_left,
        window_right,
        float(softcap),
        alibi,
    )


def _decode_query(
    op: str,
    query: object,
    query_scale: object,
    kc: torch.Tensor,
    num_kv_heads: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 query [T, H, D] and its scales [T, H] float32, against the HND cache's heads,
    block size and head size."""
    qi = _int8(op, "query", query, 3)
    t, h, d = qi.shape
    qs = _f32(op, "query_scale", query_scale, (t, h))
    _head_size(op, d)
    if num_kv_heads != kc.shape[1] or block_size != kc.shape[2] or d != kc.shape[3]:
        raise _fail(
            op,
            f"num_kv_heads / block_size {num_kv_heads} / {block_size} and head size {d} do not "
            f"match the HND cache {tuple(kc.shape)}",
        )
    if h % num_kv_heads:
        raise _fail(op, f"{h} query heads are not a multiple of {num_kv_heads} kv heads")
    return qi, qs


def _decode_rows(
    op: str,
    qi: torch.Tensor,
    bt: torch.Tensor,
    context_lens: object,
    cu_query_lens: object,
    max_query_len: int | None,
    max_context_len: int,
) -> tuple[list[int], list[int]]:
    """Each sequence's query rows (cumulative ends over the query's rows: ``cu_query_lens``,
    or one row each) and its key count (``context_lens``), checked against the max lengths and
    each other (a sequence holds at least its queries)."""
    t, b = qi.shape[0], bt.shape[0]
    lens_t = _int32(op, "context_lens", context_lens, 1)
    if lens_t.shape[0] != b:
        raise _fail(op, f"context_lens has {lens_t.shape[0]} entries, block_tables {b} rows")
    _same_device(op, qi, block_tables=bt, context_lens=lens_t)
    if cu_query_lens is None:
        if b != t:
            raise _fail(op, f"without cu_query_lens, one query row per sequence: {t} vs {b}")
        ends = list(range(t + 1))
    else:
        cu = _int32(op, "cu_query_lens", cu_query_lens, 1)
        _same_device(op, qi, cu_query_lens=cu)
        ends = _cumulative(op, "cu_query_lens", cu, b)
        if ends[-1] > t:
            raise _fail(op, f"cu_query_lens ends at {ends[-1]}, query has only {t} rows")
        if max_query_len is None:
            raise _fail(op, "cu_query_lens needs max_query_len")
    q_lens = [y - x for x, y in itertools.pairwise(ends)]
    if q_lens and max_query_len is not None and max(q_lens) > max_query_len:
        raise _fail(op, f"max_query_len {max_query_len} is below the longest {max(q_lens)}")
    lens = [int(x) for x in lens_t.tolist()]
    if lens and max(lens) > max_context_len:
        raise _fail(op, f"context_lens {lens} exceed max_context_len={max_context_len}")
    short = [r for r in range(b) if lens[r] < q_lens[r]]
    if short:
        r = short[0]
        raise _fail(op, f"sequence {r}: {q_lens[r]} queries over {lens[r]} keys")
    return ends, lens


def _decode_saves(
    op: str,
    saves: tuple[object, object, object],
    kc: torch.Tensor,
    vc: torch.Tensor,
    table: list[list[int]],
    ends: list[int],
    lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The fused KV write's ``save_key`` (int8), ``save_value``, ``save_key_scale`` and the
    slot of each query row: the positions before each sequence's ``context_lens``."""
    save_key, save_value, save_key_scale = saves
    n, d = ends[-1], kc.shape[3]
    sk = _int8(op, "save_key", save_key, 3)
    sv = _tensor(op, "save_value", save_value, 3)
    if tuple(sk.shape[1:]) != (kc.shape[1], d) or sk.shape[0] < n or sv.shape != sk.shape:
        raise _fail(op, f"save_key / save_value must be ({n}, {kc.shape[1]}, {d})")
    if sv.dtype != vc.dtype:
        raise _fail(op, f"save_value must be {vc.dtype}, got {sv.dtype}")
    if not sv.is_contiguous():
        raise _fail(op, "save_value must be contiguous (the fork makes it so)")
    ss = _f32(op, "save_key_scale", save_key_scale, (sk.shape[0], kc.shape[1]))
    bs = kc.shape[2]
    slots = [-1] * sk.shape[0]
    for r, blocks in enumerate(table):
        q_len = ends[r + 1] - ends[r]
        for i in range(q_len):
            pos = lens[r] - q_len + i
            if pos // bs >= len(blocks) or not 0 <= blocks[pos // bs] < kc.shape[0]:
                raise _fail(op, f"sequence {r}: position {pos} has no valid block")
            slots[ends[r] + i] = blocks[pos // bs] * bs + pos % bs
    return sk, sv, ss, slots


@emulation.kernel(null=emulation.skip)  # writes ``output`` in place
def _paged_decode_math(
    op: str,
    o: torch.Tensor,
    qi: torch.Tensor,
    qs: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    dq: _Dequant,
    table: list[list[int]],
    lens: list[int],
    ends: list[int],
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi: torch.Tensor | None,
) -> None:
    """``_paged_decode``'s attention, every argument checked by it."""
    qf = qi.float() * qs[..., None]
    for r in range(len(lens)):
        if ends[r] == ends[r + 1]:
            continue
        k, v = _read_sequence(kc, vc, table[r], lens[r], op, dq)
        res, _ = _attend(
            qf[ends[r] : ends[r + 1]],
            k,
            v,
            scale=scale,
            causal=causal,
            window=(window_left, window_right),
            softcap=softcap,
            alibi=alibi,
        )
        o[ends[r] : ends[r + 1]] = res.to(o.dtype)


@_op("inference.functions.vllm_paged_attention_int8")
def vllm_paged_attention_int8(
    *,  # the fork passes every argument by keyword; the order is not public
    output: torch.Tensor,  # [T, H, D] float16/bfloat16, written
    query: torch.Tensor,  # [T, H, D] int8
    key_cache: torch.Tensor,  # HND int8
    value_cache: torch.Tensor,  # HND int8
    query_scale: torch.Tensor,  # [T, H] float32 (not transposed) [callers]
    key_scale_cache: torch.Tensor,  # [num_blocks, Hkv, block_size] float32
    value_scale_cache: torch.Tensor,  # [Hkv, D] float32, static
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32: keys per sequence, its queries' own included
    block_size: int,
    max_context_len: int,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    use_sqrt_alibi: bool = False,
    use_cuda_graph: bool = False,  # the capture-safe launch (_capture_safe); the same math
    cu_query_lens: torch.Tensor | None = None,  # [B + 1] int32 over the query rows
    max_query_len: int | None = None,
    save_key: torch.Tensor | None = None,  # [T, Hkv, D] int8: fused KV write
    save_value: torch.Tensor | None = None,  # [T, Hkv, D] int8
    save_key_scale: torch.Tensor | None = None,  # [T, Hkv] float32
) -> None:
    op = "vllm_paged_attention_int8"
    _capture_safe(op, use_cuda_graph, max_context_len)
    kc, vc, ks = _quant_cache(op, key_cache, value_cache, key_scale_cache, mix=False)
    vs = _f32(op, "value_scale_cache", value_scale_cache, (kc.shape[1], kc.shape[3]))
    _paged_decode(
        op,
        output,
        query,
        query_scale,
        kc,
        vc,
        _Dequant(ks, vs),
        num_kv_heads,
        scale,
        block_tables,
        context_lens,
        block_size,
        max_context_len,
        alibi_slopes,
        causal,
        window_left,
        window_right,
        softcap,
        use_sqrt_alibi,
        cu_query_lens,
        max_query_len,
        (save_key, save_value, save_key_scale),
    )


@_op("inference.functions.vllm_paged_attention_mix")
def vllm_paged_attention_mix(
    *,
    output: torch.Tensor,  # [T, H, D] float16/bfloat16, written
    query: torch.Tensor,  # [T, H, D] int8
    key_cache: torch.Tensor,  # HND int8
    value_cache: torch.Tensor,  # HND float16/bfloat16
    query_scale: torch.Tensor,  # [T, H] float32
    key_scale_cache: torch.Tensor,  # [num_blocks, Hkv, block_size] float32
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int,
    alibi_slopes: torch.Tensor | None = None,
    causal: bool = True,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    use_sqrt_alibi: bool = False,
    use_cuda_graph: bool = False,
    cu_query_lens: torch.Tensor | None = None,
    max_query_len: int | None = None,
    save_key: torch.Tensor | None = None,  # [T, Hkv, D] int8
    save_value: torch.Tensor | None = None,  # [T, Hkv, D] float16/bfloat16, contiguous
    save_key_scale: torch.Tensor | None = None,  # [T, Hkv] float32
) -> None:
    op = "vllm_paged_attention_mix"
    _capture_safe(op, use_cuda_graph, max_context_len)
    kc, vc, ks = _quant_cache(op, key_cache, value_cache, key_scale_cache, mix=True)
    _paged_decode(
        op,
        output,
        query,
        query_scale,
        kc,
        vc,
        _Dequant(ks, None),
        num_kv_heads,
        scale,
        block_tables,
        context_lens,
        block_size,
        max_context_len,
        alibi_slopes,
        causal,
        window_left,
        window_right,
        softcap,
        use_sqrt_alibi,
        cu_query_lens,
        max_query_len,
        (save_key, save_value, save_key_scale),
    )


# --- the namespaces the backend reaches the ops through -----------------------------------------


def _namespace(**ops: Callable[..., Any]) -> SimpleNamespace:
    return SimpleNamespace(**ops)


contrib = SimpleNamespace(
    vllm_flash_attn=_namespace(
        flash_attn_varlen_func=flash_attn_varlen_func,
        flash_attn_with_kvcache=flash_attn_with_kvcache,
        flash_attn_varlen_int8_func=flash_attn_varlen_int8_func,
        merge_attn_states=merge_attn_states,
    )
)
inference = SimpleNamespace(
    functions=_namespace(
        reshape_and_cache_flash=reshape_and_cache_flash,
        scaled_int8_quant_for_attn=scaled_int8_quant_for_attn,
        reshape_and_cache_flash_int8=reshape_and_cache_flash_int8,
        reshape_and_cache_flash_mix=reshape_and_cache_flash_mix,
        vllm_paged_attention_int8=vllm_paged_attention_int8,
        vllm_paged_attention_mix=vllm_paged_attention_mix,
    )
)
