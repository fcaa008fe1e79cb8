"""A pure-PyTorch CPU emulator of exactly the FlashAttention functions ``attnhub_flash`` calls.

On a machine without an NVIDIA GPU, ``ops.py`` hands the backend these namespaces instead of the
real modules, so the backend's real translation code runs on CPU. Each function has its
provider's name, parameter names, defaults, positional order (checked against the published
interfaces by ``backends/flash/tests/test_flash_contract.py``), layouts, length conventions and
return values:

  VLLM  ``vllm.vllm_flash_attn``  flash_attn_varlen_func (fa_version 2, or 3 with s_aux and
                                  scheduler_metadata), get_scheduler_metadata (FA3)
        ``vllm._custom_ops``      reshape_and_cache_flash, concat_and_cache_mla (MLA)
  FA2   ``flash_attn``            flash_attn_varlen_func, flash_attn_with_kvcache (2.8.3)
  FA3   ``flash_attn_interface``  flash_attn_with_kvcache (hopper, 2.8.3: ``page_table``)
  FA4   ``flash_attn.cute``       flash_attn_varlen_func (4.0.0b36: ``page_table``)
  FLASHMLA ``vllm.v1.attention.ops.flashmla``  get_mla_metadata, flash_mla_with_kvcache
        (vLLM 0.33's FlashMLA interface: the dense decode of MLA's absorbed form, SM90)

Conventions, as the interfaces' docstrings and asserts state them (``[inferred]`` marks our
reading where they are silent; docs/backends/flash.md lists every one):
  - causal and window masks are **bottom-right aligned**: query i of a sequence with q_len Sq
    and kv_len Sk sees keys [i + Sk - Sq - left, i + Sk - Sq + right]; -1 (FA4: None) is
    unbounded; ``causal`` forces right = 0 [doc].
  - softcap after scaling (``cap * tanh(s / cap)``), then the ALiBi bias
    ``-slope * |i + Sk - Sq - j|`` [doc; their order inferred], then the mask. FA2's kernels
    on their causal branch add ``+slope * j`` instead: the same output, an LSE higher by
    ``slope * (i + Sk - Sq)`` [source: mask.h] (``_Rules.causal_alibi_column_bias``).
  - a row that sees no key: output 0 [doc: "If the row of the mask is all zero, the output will
    be zero"]; LSE +inf on FA2 and vLLM's ``fa_version=2``, -inf on FA3 (hopper, and vLLM's
    ``fa_version=3``) and FA4 [source: FA2 flash_api.cpp / softmax.h, hopper softmax.h and
    epilogue_fwd.hpp; FA4 ``lse.fill_(float("-inf"))``]. The fork's FA3 adds ``s_aux`` in
    ``finalize_aux`` (a key-less row gets the sink alone) but stores a sequence without keys
    by ``store_zero``, without the sink [source]. LSE is the natural log, float32,
    (nheads, total_q) for varlen calls and (batch, nheads, seqlen_q) for padded-batch queries.
  - FA4 ``learnable_sink``: one logit per query head joins the softmax denominator, unscaled,
    with no value [schema: ``apply_learnable_sink``].
  - paged K/V (NHD): (num_blocks, page_size, nheads_k, headdim), block table int32
    (batch, max_blocks); rules per provider on ``page_size`` (vLLM's fork: multiple of 16
    [callers]; FA2: multiple of 256 [source]; FA3: arbitrary [doc]; FA4: arbitrary for head
    sizes that are multiples of 16, else its key tile only, per architecture [source]).
  - FA4 models the architecture FA4 itself selects by (``FLASH_ATTENTION_ARCH``, else the GPU,
    else SM100: ``attnhub_flash.ops.fa4_arch``).
  - length tensors and slot mappings are checked with ``is_contiguous()`` (``CHECK_CONTIGUOUS``),
    data tensors and tables with ``stride(-1) == 1``, as the library checks each.

It is strict: a call the library rejects (wrong dtype, layout, a missing or doubled length
argument, a block table that is not int32) raises :class:`FlashOpError`; a valid call that uses
something not emulated (dropout, rotary, fp8 e5m2, new K/V appended by the kernel) raises
:class:`NotEmulatedError`. It computes in float32 and never calls ``attnhub.reference`` (the
conformance suite compares the two).
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional, Union

import torch

from attnhub.kit import emulation, kernel_call
from attnhub_flash.ops import fa4_arch

#: These functions stand in for the GPU: a host read made inside them is a read on the device,
#: which attnhub's host-sync guard (the conformance suite's) allows.
__attnhub_device_code__ = True

__all__ = [
    "FA2",
    "FA3",
    "FA4",
    "FLASHMLA",
    "VLLM",
    "VLLM_CACHE_OPS",
    "Call",
    "FlashOpError",
    "NotEmulatedError",
    "call_counts",
    "record_calls",
    "reset_call_counts",
]

MODEL_DTYPES = (torch.float16, torch.bfloat16)
FP8 = torch.float8_e4m3fn


class FlashOpError(RuntimeError):
    """A call the real library rejects (its ``TORCH_CHECK``s raise RuntimeError)."""


class NotEmulatedError(NotImplementedError):
    """A valid call that uses something this emulator does not implement."""


# --- call accounting (tests read the calls a step makes) ----------------------------------------

_log = emulation.OpLog()
#: One emulated call, as the caller made it (``name``: "module.function").
Call = emulation.Call
#: "module.function" -> number of calls since the last reset.
call_counts: Counter[str] = _log.counts
reset_call_counts = _log.reset_counts
#: Collect every emulated call made inside the block (name, args, kwargs).
record_calls = _log.record


def _counted(module: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The op, as a device launches it: inside a capture on attnhub's eager tape, one opaque
    tape entry (``kernel_call``): its tensors read at every replay, its host arguments as they
    were at capture, as a CUDA graph records one kernel launch."""
    name = f"{module}.{fn.__name__}"
    op = _log.op(name, fn, binding=name, route=kernel_call)
    op.__qualname__ = name
    return op


# --- checks ------------------------------------------------------------------------------------


def _fail(op: str, message: str) -> FlashOpError:
    return FlashOpError(f"{op}: {message}")


def _not_emulated(op: str, **params: object) -> None:
    for name, value in params.items():
        if value is not None and value is not False:
            raise NotEmulatedError(
                f"{op}: {name} is valid but not emulated (attnhub_flash does not use it)"
            )


def _tensor(
    op: str, name: str, t: object, dims: int, device: torch.device, *, contiguous: bool = False
) -> torch.Tensor:
    """A tensor argument: its rank, device and layout. The layout check is the library's:
    ``TORCH_CHECK(x.stride(-1) == 1)`` for data tensors, or with ``contiguous``
    ``CHECK_CONTIGUOUS(x)`` (``x.is_contiguous()``, true for any tensor of at most one
    element whatever its strides) for lengths and slots [source: flash_api.cpp]."""
    if not isinstance(t, torch.Tensor):
        raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise _fail(op, f"{name} must be {dims}-D, got shape {list(t.shape)}")
    if t.device != device:
        raise _fail(op, f"{name} is on {t.device}, q on {device}")
    if contiguous:
        if not t.is_contiguous():
            raise _fail(op, f"{name} must be contiguous, got strides {list(t.stride())}")
    elif t.numel() and t.stride(-1) != 1:
        raise _fail(op, f"{name} must have contiguous last dimension")
    return t


def _int32(
    op: str, name: str, t: object, shape: tuple[int, ...], device: torch.device
) -> list[int]:
    """An int32 length tensor of ``shape`` (``CHECK_CONTIGUOUS``), read (on the 'device': this
    module is device code)."""
    t = _tensor(op, name, t, len(shape), device, contiguous=True)
    if t.dtype != torch.int32:
        raise _fail(op, f"{name} must have dtype int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise _fail(op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    return t.reshape(-1).tolist()


@dataclass(frozen=True)
class _Rules:
    """One provider's limits on what its kernels take."""

    lib: str
    head_ok: Callable[[int], bool]
    head_rule: str
    page_multiple: int
    #: the LSE of a row that sees no key: +inf on FA2 (``softmax_lse.fill_(infinity)`` and
    #: ``Split ? -INFINITY : INFINITY`` in softmax.h), -inf on FA3 (hopper ``softmax.h``
    #: ``finalize``, ``epilogue_fwd.hpp`` ``store_zero``) and FA4 [source]
    empty_lse: float
    #: FA3 (hopper): a sequence with no key tile (seqlen_k = 0) is stored as zeros with LSE
    #: -inf by ``store_zero``, without the sink (s_aux joins only in ``finalize_aux``) [source]
    empty_sequence_drops_sink: bool = False
    #: A value head size other than q/k's: None where the kernels take none (v must have k's
    #: shape: FA2's ``CHECK_SHAPE(v, ..., head_size)``), else the check of a
    #: ``(head_size, head_size_v)`` pair for q's dtype (raises; ``_fa3_head_size_v``).
    head_size_v: Callable[[str, int, int, torch.dtype], None] | None = None
    #: FA2's kernels (upstream and the fork's ``fa_version=2``): on their causal branch the
    #: ALiBi bias is ``+slope * j`` ("we add the same bias vector to all rows"), not
    #: ``-slope * |i + Sk - Sq - j|``: the same softmax, but the LSE is higher by
    #: ``slope * (i + Sk - Sq)`` [source: csrc/flash_attn/src/mask.h ``Mask::apply_mask``]
    #: (``_fa2_causal_branch`` says when that branch runs).
    causal_alibi_column_bias: bool = False


#: FA3's value head sizes other than q/k's [source: hopper/flash_api.cpp mha_fwd, upstream
#: 2.8.3 and vLLM's fork alike, whose CMake build keeps both FLASHATTENTION_DISABLE_HDIMDIFF*
#: commented out]: keys in (128, 192] with values in (96, 128] (the hdim 192 x hdimv 128
#: kernels), or keys <= 64 with values <= 512 (64 x 64, 64 x 256, 64 x 512).
FA3_HDIMDIFF_LONG = ((129, 192), (97, 128))
FA3_HDIMDIFF_SHORT = ((1, 64), (1, 512))


def _fa3_head_size_v(op: str, head_size: int, head_size_v: int, dtype: torch.dtype) -> None:
    """mha_fwd's checks of a V head size other than Q/K's, in its order [source], on Hopper
    (the emulator is a 9.x GPU: 'Only Hopper supports different V headdim' is the backend's
    device check). Calls the check passes whose kernel is not the one the host plans for
    (below) raise NotEmulatedError: valid, but not what attnhub uses or emulates."""
    (k_lo, k_hi), (v_lo, v_hi) = FA3_HDIMDIFF_LONG
    long = k_lo <= head_size <= k_hi and v_lo <= head_size_v <= v_hi
    short = head_size <= FA3_HDIMDIFF_SHORT[0][1] and head_size_v <= FA3_HDIMDIFF_SHORT[1][1]
    if not (long or short):
        raise _fail(
            op,
            "If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] "
            f"and V headdim in (96, 128], or (Q/K <= 64 and V <= 512); got {head_size} / "
            f"{head_size_v}",
        )
    if head_size_v > 256 and dtype not in MODEL_DTYPES:
        raise _fail(op, f"HeaddimV > 256 requires fp16 and bf16 data type (got {dtype})")
    alignment = 16 if dtype == FP8 else 8
    for name, size in (("head_size", head_size), ("head_size_v", head_size_v)):
        if size % alignment:
            raise _fail(op, f"{name} should be a multiple of {alignment}, got {size}")
    if short and head_size_v > 64:
        if dtype == FP8:
            # run_mha_fwd builds e4m3 kernels of hdim 64 x hdimv 64 only: a wider V would run
            # on a kernel whose V tile is narrower than it [source: run_mha_fwd_constexpr]
            raise NotEmulatedError(
                f"{op}: fp8 with head_size {head_size} and head_size_v {head_size_v} passes "
                "mha_fwd's checks but FA3 builds its fp8 hdim-64 kernels for hdimv 64 only; "
                "not emulated"
            )
        if head_size_v <= 192:
            # the kernel is 64 x 256, but the host plans its tiles (paged-KV TMA, splits, GQA
            # packing: 'This needs to match the kernel configs') for hdimv rounded to 128 or
            # 192, the 64 x 64 kernel's tiles [source: get_pagedkv_tma, get_num_splits,
            # round_up_headdimv, tile_size_fwd_sm90]; FA3's own tests take hdimv 256 and 512
            # with hdim <= 64 [source: hopper/test_flash_attn.py dv_vals] [inferred]
            raise NotEmulatedError(
                f"{op}: head_size {head_size} with head_size_v {head_size_v} passes mha_fwd's "
                "checks, but the host plans the tiles of hdimv "
                f"{128 if head_size_v <= 128 else 192} for the hdim 64 x hdimv 256 kernel it "
                "runs; not emulated"
            )


def _check_qkv(
    op: str,
    rules: _Rules,
    q: object,
    k: object,
    v: object,
    *,
    paged: bool,
    fp8: bool = False,  # FA3 kernels: fp8 e4m3 q, k and v too
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not isinstance(q, torch.Tensor):
        raise _fail(op, f"q must be a Tensor, got {type(q).__name__}")
    dev = q.device
    q = _tensor(op, "q", q, 3, dev)
    k = _tensor(op, "k", k, 4 if paged else 3, dev)
    v = _tensor(op, "v", v, 4 if paged else 3, dev)
    if fp8 and q.dtype == FP8:
        pass  # "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type" [source]
    elif q.dtype not in MODEL_DTYPES:
        kinds = "fp16, bf16 and fp8_e4m3" if fp8 else "fp16 and bf16"
        raise _fail(op, f"{rules.lib} supports only {kinds} here, got q {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _fail(op, f"query and key/value must have the same dtype: {q.dtype}, {k.dtype}")
    distinct_v = rules.head_size_v is not None and k.shape[:-1] == v.shape[:-1]
    if k.shape != v.shape and not distinct_v:
        raise _fail(op, f"k {list(k.shape)} and v {list(v.shape)} must have the same shape")
    num_heads, head_size = q.shape[1:]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_size:
        raise _fail(op, f"k head size {k.shape[-1]} != q head size {head_size}")
    if num_heads % num_kv_heads:
        raise _fail(op, f"nheads {num_heads} must be divisible by nheads_k {num_kv_heads}")
    if v.shape[-1] != head_size:  # the pair's own rule (its head size included)
        assert rules.head_size_v is not None
        rules.head_size_v(op, head_size, v.shape[-1], q.dtype)
    elif not rules.head_ok(head_size):
        raise _fail(op, f"head size {head_size}: {rules.lib} supports {rules.head_rule}")
    if q.dtype == FP8 and head_size % 16:  # alignment 16 for fp8, 8 otherwise [source]
        raise _fail(op, f"head_size should be a multiple of 16 (fp8 inputs), got {head_size}")
    if paged:
        page = k.shape[1]
        if page % rules.page_multiple:
            raise _fail(
                op, f"paged KV block size {page} must be a multiple of {rules.page_multiple}"
            )
    return q, k, v


#: FA3's value query (``qv`` upstream, ``q_v`` in vLLM's fork) [source: hopper/flash_api.cpp
#: mha_fwd]: q/k head size at most 64, v head size in [256, 512] (the hdim 64 x hdimv 256 / 512
#: kernels; "(Q/K <= 64 and V <= 512)" for a V head size other than Q/K's), both aligned to 8.
QV_MAX_HEAD_SIZE = 64
QV_HEAD_SIZE_V = (256, 512)


def _check_qv(
    op: str,
    rules: _Rules,
    name: str,  # the argument's name: "qv" (upstream) or "q_v" (vLLM's fork)
    q: object,
    k: object,
    v: object,
    qv: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call with FA3's value query over a paged cache (MLA's absorbed form, as vLLM's
    FLASH_ATTN_MLA makes it: q the rope part [total_q, H, 64], qv the latent part
    [total_q, H, 512], k the rope plane and v the latent plane of one joint cache, one kv
    head): mha_fwd's checks [source: hopper/flash_api.cpp], in its order where it matters."""
    if not isinstance(q, torch.Tensor):
        raise _fail(op, f"q must be a Tensor, got {type(q).__name__}")
    dev = q.device
    q = _tensor(op, "q", q, 3, dev)
    k = _tensor(op, "k", k, 4, dev)
    v = _tensor(op, "v", v, 4, dev)
    if q.dtype not in MODEL_DTYPES:
        raise _fail(op, f"{name} is only supported for fp16 and bf16 data type (q {q.dtype})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise _fail(op, f"query and key/value must have the same dtype: {q.dtype}, {k.dtype}")
    num_heads, head_size = q.shape[1:]
    head_size_v = v.shape[-1]
    if k.shape[:-1] != v.shape[:-1]:
        raise _fail(op, f"k {list(k.shape)} and v {list(v.shape)} must agree but for the head size")
    if k.shape[-1] != head_size:
        raise _fail(op, f"k head size {k.shape[-1]} != q head size {head_size}")
    if num_heads % k.shape[-2]:
        raise _fail(op, f"nheads {num_heads} must be divisible by nheads_k {k.shape[-2]}")
    if head_size % 8 or head_size_v % 8:
        raise _fail(
            op, f"head_size {head_size} and head_size_v {head_size_v} must be multiples of 8"
        )
    if head_size > QV_MAX_HEAD_SIZE:
        raise _fail(op, f"{name} is only supported for head_size <= 64, got {head_size}")
    lo, hi = QV_HEAD_SIZE_V
    if head_size_v < lo:
        raise _fail(op, f"{name} is only supported for hdim_v >= 256, got {head_size_v}")
    if head_size_v > hi:
        raise _fail(
            op,
            "If V headdim is different from Q/K dim, we only support Q/K headdim in (128, 192] "
            f"and V headdim in (96, 128], or (Q/K <= 64 and V <= 512); got {head_size} / "
            f"{head_size_v}",
        )
    qv = _tensor(op, name, qv, 3, dev)
    if qv.dtype != q.dtype:
        raise _fail(op, f"{name} must have the same dtype as query ({qv.dtype}, {q.dtype})")
    if tuple(qv.shape) != (q.shape[0], num_heads, head_size_v):
        raise _fail(
            op,
            f"{name} must have shape {[q.shape[0], num_heads, head_size_v]} (total_q, nheads, "
            f"head_size_v), got {list(qv.shape)}",
        )
    page = k.shape[1]
    if page % rules.page_multiple:
        raise _fail(op, f"paged KV block size {page} must be a multiple of {rules.page_multiple}")
    return q, k, v, qv


def _window(
    op: str, window_size: object, causal: bool, *, none_is_unbounded: bool
) -> tuple[int, int]:
    """(left, right) with -1 = unbounded; ``causal`` forces right = 0 [doc]."""
    if window_size is None:
        left, right = -1, -1
    else:
        pair: tuple[Any, ...] = tuple(window_size) if isinstance(window_size, (tuple, list)) else ()
        if len(pair) != 2:
            raise _fail(op, f"window_size must be a pair, got {window_size!r}")
        a, b = (-1 if x is None and none_is_unbounded else x for x in pair)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in (a, b)):
            raise _fail(op, f"window_size must hold ints, got {window_size!r}")
        left, right = a, b
    if causal:
        right = 0
    return left, right


def _alibi(
    op: str, slopes: object, num_heads: int, batch: int, dev: torch.device
) -> torch.Tensor | None:
    if slopes is None:
        return None
    t = _tensor(
        op, "alibi_slopes", slopes, 1 if getattr(slopes, "dim", lambda: 0)() == 1 else 2, dev
    )
    if t.dtype != torch.float32:
        raise _fail(op, f"alibi_slopes must have dtype fp32, got {t.dtype}")
    if tuple(t.shape) not in ((num_heads,), (batch, num_heads)):
        raise _fail(
            op, f"alibi_slopes must have shape (nheads) or (batch, nheads), got {list(t.shape)}"
        )
    return t if t.dim() == 2 else t.expand(batch, num_heads)


def _softcap(op: str, softcap: object) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise _fail(op, f"softcap must be a float >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def _descales(
    op: str,
    q: torch.Tensor,
    batch: int,
    num_kv_heads: int,
    q_descale: object,
    k_descale: object,
    v_descale: object,
) -> torch.Tensor | None:  # [batch, 3, Hk] float32 (q, k, v), or None: not an fp8 call
    """FA3's descales, read only when q is fp8 (ignored otherwise) [source: flash_api.cpp
    mha_fwd]: each float32 (batch_size, num_heads_k), any strides (the kernel takes a batch
    and a head stride, so ``scale.expand(B, Hk)`` as vLLM passes it is fine); a missing one
    is 1."""
    if q.dtype != FP8:
        return None
    planes = []
    given_scales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    for name, given in given_scales:
        if given is None:
            planes.append(torch.ones(batch, num_kv_heads, dtype=torch.float32, device=q.device))
            continue
        t = given
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise _fail(op, f"{name} is on {t.device}, q on {q.device}")
        if tuple(t.shape) != (batch, num_kv_heads):
            raise _fail(
                op, f"{name} must have shape ({batch}, {num_kv_heads}), got {list(t.shape)}"
            )
        if t.dtype != torch.float32:  # data_ptr<float>()
            raise _fail(op, f"{name} must have dtype float32, got {t.dtype}")
        planes.append(t.float())
    return torch.stack(planes, dim=1)


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    """fp8 inputs write bf16 outputs, others their own dtype [source: mha_fwd]."""
    return torch.bfloat16 if q.dtype == FP8 else q.dtype


def _fp8_block_n(head_size: int, window: tuple[int, int]) -> int:
    """The key tile (kBlockN) of FA3's fp8 forward on Hopper for a paged cache read without
    TMA (page size other than the tile) by two MMA warpgroups [source: hopper/tile_size.h
    ``tile_size_fwd_sm90``, element_size 1]. It decides only against which running maximum
    each probability is rounded; the kernel's choice of the one-warpgroup variant and of
    split-KV (``num_splits``), which change the tiling too, are not modeled [inferred]."""
    left, right = window
    local = (left >= 0 or right >= 0) and not (left < 0 and right == 0)
    if head_size <= 64:
        return 160
    if head_size <= 96:
        return 128
    if head_size <= 128:
        return 160
    if head_size <= 192:
        return 128 if local else 160  # (paged_kv_non_TMA || softcap) && is_local
    return 64 if local else 128


# --- the math ----------------------------------------------------------------------------------


def _attend(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [kv_len, Hk, D]
    v: torch.Tensor,
    *,
    scale: float,
    window: tuple[int, int],  # (left, right), -1 = unbounded
    softcap: float,
    slopes: torch.Tensor | None,  # [H] float32
    sink: torch.Tensor | None,  # [H] float32 logits joining the denominator
    empty_lse: float,
    descale: torch.Tensor | None = None,  # [3, Hk] float32 (q, k, v): an fp8 call
) -> tuple[torch.Tensor, torch.Tensor]:  # out [q_len, H, D] f32, lse [H, q_len] f32
    q_len, num_heads, head_size = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().permute(1, 0, 2)  # [H, q_len, D]
    kf = k.float().repeat_interleave(group, dim=1).permute(1, 0, 2)  # [H, kv_len, D]
    vf = v.float().repeat_interleave(group, dim=1).permute(1, 0, 2)
    s = torch.bmm(qf, kf.transpose(1, 2))  # [H, q_len, kv_len]
    if descale is not None:  # fp8: q_descale * k_descale join the softmax scale [source]
        per_head = descale.repeat_interleave(group, dim=1)  # [3, H]
        s = s * (scale * per_head[0] * per_head[1])[:, None, None]
    else:
        s = s * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    # bottom-right alignment: query i sits at key position i + kv_len - q_len
    d = torch.arange(kv_len)[None, :] - (torch.arange(q_len)[:, None] + kv_len - q_len)
    if slopes is not None:
        s = s - slopes.float()[:, None, None] * d.abs().float()[None]
    left, right = window
    keep = torch.ones(q_len, kv_len, dtype=torch.bool)
    if left >= 0:
        keep &= d >= -left
    if right >= 0:
        keep &= d <= right
    s = s.masked_fill(~keep[None], -math.inf)
    if descale is not None:
        block_n = _fp8_block_n(head_size, window)
        out, lse = _fp8_softmax_pv(s, vf, sink, block_n, empty_lse)
        return out * per_head[2][None, :, None], lse  # v_descale scales the output [source]
    parts = [s] if sink is None else [s, sink.float()[:, None, None].expand(num_heads, q_len, 1)]
    full = torch.cat(parts, dim=-1)
    m = (
        full.amax(dim=-1, keepdim=True)
        if full.shape[-1]
        else full.new_full((num_heads, q_len, 1), -math.inf)
    )
    safe_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(full - safe_m)
    denom = e.sum(dim=-1, keepdim=True)
    empty = denom == 0
    p = e[..., :kv_len] / torch.where(empty, torch.ones_like(denom), denom)
    out = torch.bmm(p, vf).permute(1, 0, 2)  # [q_len, H, D]
    lse = torch.where(empty, torch.full_like(denom, empty_lse), torch.log(denom) + safe_m)
    return out, lse.squeeze(-1)


def _fp8_softmax_pv(
    s: torch.Tensor,  # [H, q_len, kv_len] float32 scaled scores, masked keys -inf
    v: torch.Tensor,  # [H, kv_len, D] float32 (the fp8 values)
    sink: torch.Tensor | None,  # [H]
    block_n: int,
    empty_lse: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [q_len, H, D] f32 (before v_descale), lse
    """FA3's fp8 online softmax [source: hopper/softmax.h, flash_fwd_kernel_sm90.h]: the keys
    in tiles of ``block_n``, the last tile first; per tile the running row maximum ``m_t``
    (over the tiles seen so far), ``P = exp2((s - m_t) * log2(e) + 8)`` (``Max_offset = 8``:
    at most 256) summed unrounded into the row sum, and **rounded to fp8 e4m3** (round to
    nearest even) for ``P @ V``; the accumulator rescaled by ``exp(m_t - m)`` as the maximum
    grows; at the end divided by the row sum, LSE ``m + log(sum / 2**8)``. A sink joins the
    row sum only, after the last tile, against the final maximum [inferred: vLLM's fork]."""
    num_heads, q_len, kv_len = s.shape
    tiles = -(-kv_len // block_n)
    padded = torch.nn.functional.pad(s, (0, tiles * block_n - kv_len), value=-math.inf)
    blocks = padded.view(num_heads, q_len, tiles, block_n)
    # running maximum in the kernel's order (tile T-1 first): max over tiles t..T-1
    running = blocks.amax(dim=-1).flip(-1).cummax(dim=-1).values.flip(-1)  # [H, q, T]
    final = running[..., :1] if tiles else s.new_full((num_heads, q_len, 1), -math.inf)
    safe_run = torch.where(torch.isinf(running), torch.zeros_like(running), running)
    safe_final = torch.where(torch.isinf(final), torch.zeros_like(final), final)
    p = torch.exp2((blocks - safe_run[..., None]) * math.log2(math.e) + 8.0)  # [H, q, T, N]
    rescale = torch.exp(safe_run - safe_final)[..., None]  # tile t's share at the end
    row_sum = (p * rescale).sum(dim=(-1, -2))  # [H, q] unrounded
    if sink is not None:
        row_sum = row_sum + torch.exp2(
            (sink.float()[:, None] - safe_final[..., 0]) * math.log2(math.e) + 8.0
        )
    weights = (p.to(FP8).float() * rescale).reshape(num_heads, q_len, -1)[..., :kv_len]
    acc = torch.bmm(weights, v)  # [H, q, D]
    total = row_sum  # 0: the row sees no key and has no sink
    out = acc / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    lse = torch.where(
        total > 0,
        safe_final[..., 0] + torch.log(total / 2.0**8),
        torch.full_like(total, empty_lse),
    )
    return out.permute(1, 0, 2), lse


def _check_table(
    op: str,
    cache: torch.Tensor,  # paged [num_blocks, page, Hk, D]
    table: list[list[int]],  # [B][max_blocks] (host data: device code)
    kv_lens: list[int],
    q_starts: list[int],
) -> None:
    """The pages each sequence's keys are read from exist in the paged ``cache`` (a sequence
    without queries reads nothing)."""
    page, num_blocks = cache.shape[1], cache.shape[0]
    for b, length in enumerate(kv_lens):
        if q_starts[b + 1] == q_starts[b]:
            continue
        row = table[b]
        needed = -(-length // page)
        if needed > len(row):
            raise _fail(op, f"{length} keys need {needed} blocks, the table row has {len(row)}")
        used = row[:needed]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            first = next(x for x in used if not 0 <= x < num_blocks)
            raise _fail(op, f"block table entry {first} is outside the cache ({num_blocks} blocks)")


def _paged_rows(
    cache: torch.Tensor, table_row: list[int], length: int
) -> torch.Tensor:  # [length, Hk, D], the pages checked by _check_table
    ids = table_row[: -(-length // cache.shape[1])]
    return cache[torch.tensor(ids, dtype=torch.long)].reshape(-1, *cache.shape[2:])[:length]


def _varlen(
    op: str,
    rules: _Rules,
    q: torch.Tensor,  # [total_q, H, D]
    k: torch.Tensor,  # paged [num_blocks, page, Hk, D] or packed [total_k, Hk, D]
    v: torch.Tensor,
    q_starts: list[int],  # B + 1 cumulative
    kv_lens: list[int],  # B
    kv_starts: list[int] | None,  # packed: B + 1 cumulative; None: paged
    table: list[list[int]] | None,  # [B][max_blocks] (host data: device code)
    *,
    scale: float,
    window: tuple[int, int],
    softcap: float,
    slopes: torch.Tensor | None,  # [B, H]
    sink: torch.Tensor | None,
    descale: torch.Tensor | None = None,  # [B, 3, Hk]: fp8 inputs (_descales)
    qv: torch.Tensor | None = None,  # [total_q, H, Dv]: FA3's value query (_check_qv)
    causal_branch: bool = False,  # FA2's kernel runs its causal branch (_fa2_causal_branch)
) -> tuple[torch.Tensor, torch.Tensor]:  # out [total_q, H, Dv] f32, lse [H, total_q] f32
    if table is not None:
        _check_table(op, k, table, kv_lens, q_starts)  # v has k's shape (_check_qkv)
    return _varlen_math(
        rules,
        q,
        k,
        v,
        q_starts,
        kv_lens,
        kv_starts,
        table,
        scale=scale,
        window=window,
        softcap=softcap,
        slopes=slopes,
        sink=sink,
        descale=descale,
        qv=qv,
        causal_branch=causal_branch,
    )


def _varlen_null(
    rules: _Rules, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any, **math_args: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    total_q, num_heads = q.shape[:2]
    return (
        emulation.preallocated((total_q, num_heads, v.shape[-1]), torch.float32, q.device),
        emulation.preallocated((num_heads, total_q), torch.float32, q.device),
    )


@emulation.kernel(null=_varlen_null)
def _varlen_math(
    rules: _Rules,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: list[int],
    kv_lens: list[int],
    kv_starts: list[int] | None,
    table: list[list[int]] | None,
    *,
    scale: float,
    window: tuple[int, int],
    softcap: float,
    slopes: torch.Tensor | None,
    sink: torch.Tensor | None,
    descale: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    causal_branch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [total_q, H, Dv] f32, lse [H, total_q] f32
    """``_varlen``'s math, every argument checked by it. With ``qv`` (FA3's value query,
    MLA's absorbed form): scores ``q . k + qv . v`` (the value rows are keys too), output over
    ``v`` [doc: hopper/flash_attn_interface.py 'qv'; callers: vLLM's FLASH_ATTN_MLA], computed
    as one attention of ``[q ; qv]`` over keys ``[k ; v]``. With ALiBi on FA2's causal branch
    (``causal_branch``, ``_Rules.causal_alibi_column_bias``) the LSE is the kernel's: each
    row's higher by ``slope * (i + Sk - Sq)`` (the output is the same softmax)."""
    column_bias = causal_branch and slopes is not None and rules.causal_alibi_column_bias
    total_q, num_heads = q.shape[:2]
    out = torch.zeros(total_q, num_heads, v.shape[-1], dtype=torch.float32)
    lse = torch.full((num_heads, total_q), rules.empty_lse, dtype=torch.float32)
    for b, kv_len in enumerate(kv_lens):
        lo, hi = q_starts[b], q_starts[b + 1]
        if hi == lo:
            continue
        if table is not None:
            kb = _paged_rows(k, table[b], kv_len)
            vb = _paged_rows(v, table[b], kv_len)
        else:
            assert kv_starts is not None
            kb, vb = k[kv_starts[b] : kv_starts[b + 1]], v[kv_starts[b] : kv_starts[b + 1]]
        qb = q[lo:hi]
        if qv is not None:
            qb, kb = torch.cat([qb, qv[lo:hi]], dim=-1), torch.cat([kb, vb], dim=-1)
        o, l_ = _attend(
            qb,
            kb,
            vb,
            scale=scale,
            window=window,
            softcap=softcap,
            slopes=None if slopes is None else slopes[b],
            sink=None if kv_len == 0 and rules.empty_sequence_drops_sink else sink,
            empty_lse=rules.empty_lse,
            descale=None if descale is None else descale[b],
        )
        if column_bias:
            assert slopes is not None
            # the kernel's scores carry +slope * j: every row's LSE is higher by slope times
            # its query position i + Sk - Sq (an empty row keeps its +inf)
            pos = torch.arange(hi - lo, dtype=torch.float32) + (kv_len - (hi - lo))
            l_ = torch.where(torch.isinf(l_), l_, l_ + slopes[b].float()[:, None] * pos[None])
        out[lo:hi], lse[:, lo:hi] = o, l_
    return out, lse


def _fa2_causal_branch(window: tuple[int, int], seqlen_k: int) -> bool:
    """Whether FA2's kernel runs its causal branch: the window after ``causal`` forced right to
    0 and both sides at or past ``seqlen_k`` were made unbounded (``window_size_left >=
    max_seqlen_k`` -> -1: the varlen call's ``max_seqlen_k``, kvcache's ``seqlen_k`` =
    ``max_num_blocks_per_seq * page_block_size``), then ``is_causal = window_size_left < 0 &&
    window_size_right == 0`` [source: csrc/flash_attn/flash_api.cpp ``set_params_fprop``, the
    same upstream and in vLLM's fork]."""
    left, right = (-1 if side >= seqlen_k else side for side in window)
    return left < 0 and right == 0


def _cumulative(op: str, name: str, ends: list[int], total: int | None) -> list[int]:
    lengths = list(map(operator.sub, ends[1:], ends[:-1]))
    if not ends or ends[0] != 0 or (lengths and min(lengths) < 0):
        raise _fail(op, f"{name} must be cumulative lengths from 0, got {ends[:8]}...")
    if total is not None and ends[-1] != total:
        raise _fail(op, f"{name}[-1] = {ends[-1]} must equal the packed length {total}")
    return lengths


def _max_covers(op: str, name: str, given: object, lengths: Sequence[int]) -> None:
    """The kernels size their grids by the max lengths: one too small computes garbage."""
    if isinstance(given, bool) or not isinstance(given, int):
        raise _fail(op, f"{name} must be an int, got {type(given).__name__}")
    if lengths and given < max(lengths):
        raise _fail(op, f"{name} = {given} is below the longest length {max(lengths)}")


def _out(
    op: str, out: object, like: torch.Tensor, head_size_v: int | None = None
) -> torch.Tensor | None:
    """``out=``: q's shape but v's head size (``head_size_v``: ``CHECK_SHAPE(out, total_q,
    num_heads, head_size_v)``), and q's dtype (bf16 for fp8 q: "For FP8 input, output must
    have dtype BF16" [source])."""
    if out is None:
        return None
    t = _tensor(op, "out", out, like.dim(), like.device)
    dtype = _out_dtype(like)
    shape = like.shape if head_size_v is None else (*like.shape[:-1], head_size_v)
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise _fail(op, f"out must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t


def _paged_call(
    op: str,
    rules: _Rules,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_starts: list[int],
    kv_lens: list[int],
    block_table: object,
    **math_args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch = len(kv_lens)
    table_t = _tensor(op, "block_table", block_table, 2, q.device)
    if table_t.dtype != torch.int32:
        raise _fail(op, f"block_table must have dtype torch.int32, got {table_t.dtype}")
    if table_t.shape[0] != batch:
        raise _fail(op, f"block_table has {table_t.shape[0]} rows for a batch of {batch}")
    return _varlen(op, rules, q, k, v, q_starts, kv_lens, None, table_t.tolist(), **math_args)


# --- vLLM's fork: vllm.vllm_flash_attn ---------------------------------------------------------

_VLLM_RULES = _Rules(  # fa_version=2: the fork's FA2 kernels
    "vllm_flash_attn",
    lambda d: d % 8 == 0 and d <= 256,
    "head sizes that are multiples of 8 up to 256",
    16,
    math.inf,
    causal_alibi_column_bias=True,
)
_VLLM_FA3_RULES = _Rules(  # fa_version=3: the fork's hopper kernels
    "vllm_flash_attn (FA3)",
    _VLLM_RULES.head_ok,
    _VLLM_RULES.head_rule,
    16,
    -math.inf,
    empty_sequence_drops_sink=True,
    head_size_v=_fa3_head_size_v,  # the fork's mha_fwd: upstream's checks [source]
)
#: The fork's FA3 with s_aux [source: the fork's hopper/flash_api.cpp mha_fwd]
_S_AUX_MAX_HEADS = 64


def flash_attn_varlen_func(  # type: ignore[no-untyped-def]  # vLLM's fork
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size: Optional[list[int]] = None,  # noqa: UP045 (the vendor's annotation)
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits: int = 0,
    output_scale=None,
    fa_version: int = 2,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_tensor_leading_dims=None,
    dynamic_causal=None,
):
    """vLLM's ``flash_attn_varlen_func`` as vLLM 0.32 ships it
    (``vllm/vllm_flash_attn/flash_attn_interface.py``; the standalone fork lacks
    ``output_scale`` and the FA4-only arguments after ``cp_tot_seqused_k``, so callers pass
    keywords): paged with ``block_table`` + ``seqused_k``, packed with ``cu_seqlens_k``; writes
    ``out`` when given; ``(out, lse)`` with ``return_softmax_lse``."""
    op = "vllm_flash_attn.flash_attn_varlen_func"
    _check_vllm_wrapper(
        op,
        fa_version=fa_version,
        cu_seqlens_k=cu_seqlens_k,
        seqused_k=seqused_k,
        block_table=block_table,
        output_scale=output_scale,
        scheduler_metadata=scheduler_metadata,
        descales=(q_descale, k_descale, v_descale),
        s_aux=s_aux,
        num_splits=num_splits,
        alibi_slopes=alibi_slopes,
        mask_mod=mask_mod,
        aux_tensors=aux_tensors,
    )
    _not_emulated(
        op,
        dropout_p=dropout_p or None,
        return_attn_probs=return_attn_probs,
        cp_tot_seqused_k=cp_tot_seqused_k,
        cp_world_size=None if cp_world_size == 1 else cp_world_size,
        block_sparse_tensors=block_sparse_tensors,
        aux_tensor_leading_dims=aux_tensor_leading_dims,
        dynamic_causal=dynamic_causal,
    )
    rules = _VLLM_FA3_RULES if fa_version == 3 else _VLLM_RULES
    paged = block_table is not None
    q, k, v, qv_t = _fork_inputs(op, rules, q, k, v, q_v, fa_version=fa_version, paged=paged)
    q_starts, q_lens, kv_starts, kv_lens = _varlen_lengths(
        op, q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, paged=paged, table="block_table"
    )
    _max_covers(op, "max_seqlen_q", max_seqlen_q, q_lens)
    _max_covers(op, "max_seqlen_k", max_seqlen_k, kv_lens)
    batch = len(kv_lens)
    if fa_version == 3:
        _check_fa3_splits(
            op,
            num_splits,
            scheduler_metadata,
            q.device,
            q_lens=q_lens,
            kv_lens=kv_lens,
            batch=batch,
            max_seqlen_q=int(max_seqlen_q),
            max_seqlen_k=int(max_seqlen_k),
            headdim=q.shape[-1],
            paged=paged,
            causal=bool(causal),
            window=(-1, -1) if window_size is None else tuple(window_size),
        )
    sink = None if s_aux is None else _s_aux(op, s_aux, q, v.shape[-1])
    out_t = _out(op, out, q, v.shape[-1])
    args: dict[str, Any] = dict(
        # the fork's default scale is q's head size alone, q_v or not [schema]
        scale=q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale),
        window=_window(op, window_size, bool(causal), none_is_unbounded=False),
        softcap=_softcap(op, softcap),
        slopes=_alibi(op, alibi_slopes, q.shape[1], batch, q.device),
        sink=sink,
        # FA2's kernel is not passed the descales [schema]; fp8 q only reaches FA3 (above)
        descale=_descales(op, q, batch, k.shape[-2], q_descale, k_descale, v_descale),
    )
    args["causal_branch"] = _fa2_causal_branch(args["window"], int(max_seqlen_k))
    if qv_t is not None:
        args["qv"] = qv_t
    if paged:
        res, lse = _paged_call(op, rules, q, k, v, q_starts, kv_lens, block_table, **args)
    else:
        res, lse = _varlen(op, rules, q, k, v, q_starts, kv_lens, kv_starts, None, **args)
    if out_t is None:
        out_t = res.to(_out_dtype(q))
    else:
        out_t.copy_(res)
    return (out_t, lse) if return_softmax_lse else out_t


def _fork_inputs(
    op: str,
    rules: _Rules,
    q: object,
    k: object,
    v: object,
    q_v: object,
    *,
    fa_version: int,
    paged: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The fork's q, k, v (and q_v) checked: q_v reaches only the FA3 (and FA4) kernels; with
    fa_version=2 the wrapper drops it and FA2's varlen_fwd sees q, k and v alone [schema]."""
    if q_v is not None and fa_version == 3:
        if not paged:
            raise NotEmulatedError(f"{op}: q_v without block_table is not emulated")
        return _check_qv(op, rules, "q_v", q, k, v, q_v)
    return (*_check_qkv(op, rules, q, k, v, paged=paged, fp8=fa_version == 3), None)


def _check_vllm_wrapper(
    op: str,
    *,
    fa_version: int,
    cu_seqlens_k: object,
    seqused_k: object,
    block_table: object,
    output_scale: object,
    scheduler_metadata: object,
    descales: tuple[object, object, object],
    s_aux: object,
    num_splits: int,
    alibi_slopes: object,
    mask_mod: object,
    aux_tensors: object,
) -> None:
    """The fork's wrapper's own asserts, in its order [schema]: which K/V lengths it needs,
    and what each FA version refuses."""
    if cu_seqlens_k is None and seqused_k is None:
        raise AssertionError("cu_seqlens_k or seqused_k must be provided")
    if cu_seqlens_k is not None and seqused_k is not None:
        raise AssertionError("cu_seqlens_k and seqused_k cannot be provided at the same time")
    if block_table is not None and seqused_k is None:
        raise AssertionError("seqused_k must be provided if block_table is provided")
    if output_scale is not None and fa_version != 4:
        raise AssertionError(
            f"Fused FP8 output (output_scale) is only supported by FA4, got fa_version={fa_version}"
        )
    if fa_version == 4:  # vLLM 0.32 routes it to its bundled FA4 (flash_attn.cute)
        raise NotEmulatedError(f"{op}: fa_version=4 is valid but not emulated (not used here)")
    if fa_version not in (2, 3):
        raise ValueError(f"Unsupported FA version: {fa_version}")
    for name, value in (("mask_mod", mask_mod), ("aux_tensors", aux_tensors)):
        if value is not None:
            raise NotImplementedError(f"FA{fa_version} does not support {name}")
    if fa_version == 2:
        # the FA2 kernel is not passed scheduler_metadata, nor the FA4-only arguments [schema]
        if scheduler_metadata is not None and all(d is not None for d in descales):
            raise NotImplementedError(
                "FA2 does not support scheduler_metadata, q_descale, k_descale, v_descale"
            )
        if s_aux is not None:
            raise NotImplementedError("FA2 does not support s_aux")
        if num_splits > 1:
            raise NotImplementedError("FA2 does not support num_splits > 1")
    elif alibi_slopes is not None:
        raise AssertionError("Alibi is not supported in FA3")


def _varlen_lengths(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    seqused_k: object,
    *,
    paged: bool,
    table: str,
) -> tuple[list[int], list[int], list[int] | None, list[int]]:
    """A varlen call's query starts and lengths, its packed K/V starts (None when the K/V
    lengths are ``seqused_k``, which needs the paged cache: ``table`` names its block table)
    and its K/V lengths, each checked."""
    dev = q.device
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise _fail(op, "cu_seqlens_q must be a Tensor")
    batch = cu_seqlens_q.shape[0] - 1
    q_starts = _int32(op, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), dev)
    q_lens = _cumulative(op, "cu_seqlens_q", q_starts, q.shape[0])
    kv_starts = None
    if seqused_k is not None:
        kv_lens = _int32(op, "seqused_k", seqused_k, (batch,), dev)
        if not paged:
            raise NotEmulatedError(f"{op}: seqused_k without {table} is not emulated")
    else:
        kv_starts = _int32(op, "cu_seqlens_k", cu_seqlens_k, (batch + 1,), dev)
        kv_lens = _cumulative(op, "cu_seqlens_k", kv_starts, k.shape[0])
    return q_starts, q_lens, kv_starts, kv_lens


def _check_fa3_splits(
    op: str,
    num_splits: int,
    scheduler_metadata: object,
    dev: torch.device,
    *,
    q_lens: list[int],
    kv_lens: list[int],
    **shape: Any,
) -> None:
    """FA3's split count, and ``scheduler_metadata`` (when given) sized for this call's
    ``shape`` (the keywords of ``_fa3_metadata_size``) and planned for its lengths."""
    if num_splits > 256:
        raise _fail(op, f"num_splits > 256 not supported (num_splits = {num_splits})")
    if scheduler_metadata is not None:
        size = _fa3_metadata_size(**shape, num_splits=num_splits)
        _check_metadata(op, scheduler_metadata, size, dev)
        assert isinstance(scheduler_metadata, torch.Tensor)
        planned = scheduler_metadata.tolist()
        if planned != _schedule_contents(size, shape["batch"], q_lens, kv_lens):
            raise _fail(
                op,
                "scheduler_metadata was planned for other sequence lengths than this call's "
                f"(cu_seqlens_q lengths {q_lens[:8]}, seqused_k {kv_lens[:8]}): the kernel "
                "would run another step's tile schedule; plan it with get_scheduler_metadata "
                "for this step's lengths (a captured graph: refreshed before every replay)",
            )


def _s_aux(op: str, s_aux: object, q: torch.Tensor, head_size_v: int) -> torch.Tensor:
    """FA3's sink logits, one per query head (refused on FA2 before this), with one head size
    for q, k and v [source: the fork's hopper/flash_api.cpp]."""
    dev = q.device
    if q.shape[1] > _S_AUX_MAX_HEADS:
        raise _fail(op, "We only support query heads <= 64 with S aux")
    if head_size_v != q.shape[-1]:
        raise _fail(op, "We don't support S aux with hdim != hdim_v")
    if not isinstance(s_aux, torch.Tensor):
        raise _fail(op, f"s_aux must be a Tensor, got {type(s_aux).__name__}")
    if s_aux.dtype != torch.bfloat16:
        raise _fail(op, f"We only support bf16 dtype for S aux. (got {s_aux.dtype})")
    if s_aux.device != dev:
        raise _fail(op, f"s_aux is on {s_aux.device}, q on {dev}")
    if tuple(s_aux.shape) != (q.shape[1],):
        raise _fail(op, f"s_aux must have shape (num_heads), got {list(s_aux.shape)}")
    return _tensor(op, "s_aux", s_aux, 1, dev, contiguous=True)


#: vLLM's fork, FA3: batches up to this size get per-batch scheduling vectors [source]
_PREPARE_VARLEN_MAX_BATCHES = 992


def _fa3_metadata_size(
    *,
    batch: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    headdim: int,
    paged: bool,
    causal: bool,
    window: tuple[Any, ...],
    num_splits: int,
) -> int:
    """int32 elements of FA3's scheduler metadata for a varlen call on Hopper, as the fork's
    ``mha_fwd`` and ``mha_fwd_get_scheduler_metadata`` both size it [source: vLLM's fork,
    hopper/flash_api.cpp]: a prepared-seqlen vector, a dynamic-split vector when the call
    splits (batch <= 992), a head-swizzle vector for causal or local attention, each
    ``round_up(batch, 4)`` long, then one semaphore. The window is normalized first as both
    do (a bound covering the whole sequence is none; one query token over a paged cache with
    head size <= 64 or > 128 is not causal). Read at vllm-project/flash-attention@01ed8aa;
    other versions of the fork lay out more per-batch vectors. ``num_splits <= 0`` is the
    kernel's own heuristic, which depends on the GPU's SM count: the emulator, which does not
    split, takes 1 [inferred: its own schedule]."""
    left, right = (int(window[0]), int(window[1])) if len(window) == 2 else (-1, -1)
    if left >= max_seqlen_k - 1:
        left = -1
    if right >= max_seqlen_q - 1:
        right = -1
    if (
        max_seqlen_q == 1
        and left == -1
        and right == -1
        and (headdim <= 64 or headdim > 128 or not paged)
    ):
        causal = False
    if causal:
        right = 0
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    splits = num_splits if num_splits > 0 else 1
    dynamic_split = batch <= _PREPARE_VARLEN_MAX_BATCHES and splits > 1
    vectors = 1 + int(dynamic_split) + int(is_causal or is_local)
    return 1 + -(-batch // 4) * 4 * vectors


def _schedule_contents(
    size: int, batch: int, q_lens: Sequence[int], kv_lens: Sequence[int]
) -> list[int]:
    """What the emulator's schedule holds: the GPU's per-batch tile counts and splits come
    from each sequence's query and key lengths (and the SM count) [source: the fork's
    prepare_varlen_num_blocks]; the emulator, which schedules nothing, stores the lengths
    themselves in their place [inferred: a stand-in], so that a call given a schedule planned
    for other lengths (a stale one: a captured graph replayed without re-planning it, where the
    kernel would run another step's tiles: undefined there) is refused. The first per-batch
    vector holds the key lengths, a second one (where the layout has it) the query lengths;
    the rest, and the semaphore, 0."""
    contents = [0] * size
    stride = -(-batch // 4) * 4
    contents[:batch] = list(kv_lens)
    if size > 1 + stride:
        contents[stride : stride + batch] = list(q_lens)
    return contents


def _check_metadata(op: str, metadata: object, size: int, dev: torch.device) -> None:
    """The fork's checks of a precomputed ``scheduler_metadata`` [source]."""
    if not isinstance(metadata, torch.Tensor):
        raise _fail(op, f"scheduler_metadata must be a Tensor, got {type(metadata).__name__}")
    if metadata.device != dev:
        raise _fail(op, f"scheduler_metadata must be on {dev}, got {metadata.device}")
    if tuple(metadata.shape) != (size,):
        raise _fail(
            op,
            f"scheduler_metadata has an invalid shape: {list(metadata.shape)}, this call needs "
            f"[{size}] (planned by get_scheduler_metadata for another batch size, causal flag, "
            "window or num_splits)",
        )
    if not metadata.is_contiguous():
        raise _fail(op, "scheduler_metadata must be contiguous")
    if metadata.dtype != torch.int32:
        raise _fail(op, f"scheduler_metadata must have dtype int32, got {metadata.dtype}")


def get_scheduler_metadata(  # type: ignore[no-untyped-def]  # vLLM's fork, FA3 only
    batch_size,
    max_seqlen_q,
    max_seqlen_k,
    num_heads_q,
    num_heads_kv,
    headdim,
    cache_seqlens: torch.Tensor,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q: Optional[torch.Tensor] = None,  # noqa: UP045 (the vendor's annotation)
    cu_seqlens_k_new: Optional[torch.Tensor] = None,  # noqa: UP045
    cache_leftpad: Optional[torch.Tensor] = None,  # noqa: UP045
    page_size: Optional[int] = None,  # noqa: UP045
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),
    has_softcap=False,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    """FA3's ahead-of-time tile schedule for one step (vLLM plans it once per step and passes
    it to every layer's ``flash_attn_varlen_func(scheduler_metadata=, fa_version=3)``).

    Returns the int32 tensor the kernel takes, sized as the fork sizes it
    (``_fa3_metadata_size``). Its contents are the GPU scheduler's working state (per-batch
    tile counts, splits and a semaphore, computed by a device kernel from the SM count); the
    emulator schedules nothing: it stores the lengths it was planned for in their place
    (``_schedule_contents``). What it checks, as the kernel does, is that a call gets metadata
    of the size its own batch, causal flag, window and splits need [source: the fork's mha_fwd
    CHECK_SHAPE / dtype / contiguity checks], and, where the kernel would silently run a wrong
    schedule, that it was planned for the call's own lengths [inferred]."""
    op = "vllm_flash_attn.get_scheduler_metadata"
    _not_emulated(
        op,
        cu_seqlens_k_new=cu_seqlens_k_new,
        cache_leftpad=cache_leftpad,
        max_seqlen_k_new=max_seqlen_k_new or None,
    )
    if qkv_dtype not in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        raise _fail(op, "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    if num_heads_q % num_heads_kv:
        raise _fail(op, "Number of heads in key/value must divide number of heads in query")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise _fail(op, f"cache_seqlens must be a Tensor, got {type(cache_seqlens).__name__}")
    dev = cache_seqlens.device
    kv_lens = _int32(op, "cache_seqlens", cache_seqlens.contiguous(), (batch_size,), dev)
    if cu_seqlens_q is not None:
        starts = _int32(op, "cu_seqlens_q", cu_seqlens_q, (batch_size + 1,), dev)
        q_lens = _cumulative(op, "cu_seqlens_q", starts, None)
    else:
        q_lens = [int(max_seqlen_q)] * int(batch_size)
    size = _fa3_metadata_size(
        batch=int(batch_size),
        max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k),
        headdim=int(headdim),
        paged=page_size is not None,
        causal=bool(causal),
        window=tuple(window_size),
        num_splits=int(num_splits),
    )
    contents = _schedule_contents(size, int(batch_size), q_lens, kv_lens)
    return torch.tensor(contents, dtype=torch.int32, device=dev)


def reshape_and_cache_flash(  # vllm._custom_ops
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write ``slot_mapping.size(0)`` tokens (key may hold more rows: padding) into the NHD
    cache; a slot < 0 is skipped [schema/callers, vendor-ops.md].

    The cache planes may be strided views (vLLM's per-layer tensor holds a slot's key and value
    side by side): the kernel addresses slot ``s``, head ``h``, channel ``c`` of both planes at
    ``(s // block_size) * block_stride + (s % block_size) * page_stride + h * head_stride + c``
    with the strides of ``key_cache`` [source: csrc/cache_kernels.cu], after
    ``TORCH_CHECK(key_cache.stride(0) == value_cache.stride(0))``. So: last dim contiguous, and
    ``value_cache`` laid out with ``key_cache``'s strides [inferred: the kernel does not check
    the page and head strides of ``value_cache``; a mismatch would write elsewhere, so the
    emulator refuses it rather than emulate that]. Each source row ``key[t]`` is read as
    ``num_heads * head_size`` consecutive elements from ``t * key.stride(0)`` [source], so its
    heads must be dense."""
    op = "_custom_ops.reshape_and_cache_flash"
    kc, vc, slots, valid, fp8 = _check_cache_write(
        op, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )
    _write_slots(key, value, kc, vc, slots, valid, (k_scale, v_scale) if fp8 else None)


def _check_cache_write(
    op: str,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``reshape_and_cache_flash``'s argument checks, in the kernel's order: the cache planes,
    the slots, which slots are written (``slot >= 0``), and whether the cache holds fp8."""
    dev = key.device
    _tensor(op, "key", key, 3, dev)
    _tensor(op, "value", value, 3, dev)
    kc = _tensor(op, "key_cache", key_cache, 4, dev)
    vc = _tensor(op, "value_cache", value_cache, 4, dev)
    # the kernel reads slot_mapping[i] through a raw pointer, with no stride check [source:
    # csrc/cache_kernels.cu]: a strided view would write other slots, so the emulator refuses
    # it rather than emulate that [inferred]; one element is contiguous at any stride
    slots = _tensor(op, "slot_mapping", slot_mapping, 1, dev, contiguous=True)
    if slots.dtype != torch.int64:
        raise _fail(op, f"slot_mapping must be int64, got {slots.dtype}")
    fp8 = kv_cache_dtype in ("fp8", "fp8_e4m3")
    if kv_cache_dtype != "auto" and not fp8:
        raise NotEmulatedError(f"{op}: kv_cache_dtype {kv_cache_dtype!r} is not emulated")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32:
            raise _fail(op, f"{name} must be a one-element float32 tensor")
    n = slots.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        raise _fail(op, f"key/value have fewer rows than slot_mapping ({n})")
    if fp8:
        # the kernel reinterprets the caches' bytes as fp8 (vLLM allocates them uint8 and
        # views them as float8_e4m3fn for attention) and reads key/value as the model dtype
        # [source: csrc/cache_kernels.cu DISPATCH_BY_KV_CACHE_DTYPE]
        for name, plane in (("key_cache", kc), ("value_cache", vc)):
            if plane.dtype not in (torch.uint8, FP8):
                raise _fail(op, f"{name} must hold bytes (uint8 or fp8) for fp8, got {plane.dtype}")
        if key.dtype not in (torch.float32, *MODEL_DTYPES) or value.dtype != key.dtype:
            raise _fail(op, f"key/value must be float32, fp16 or bf16, got {key.dtype}")
    elif key.dtype != kc.dtype or value.dtype != vc.dtype:
        raise _fail(op, f"key {key.dtype} and cache {kc.dtype} differ with kv_cache_dtype 'auto'")
    # the value plane may be narrower or wider than the key plane (a value head size other
    # than the key's: vLLM 0.32's FlashAttentionImpl.do_kv_cache_update splits its per-layer
    # [..., head_size + head_size_v] tensor at head_size and passes both planes [callers]);
    # each row is written at its own plane's width [inferred]
    if tuple(key.shape[1:]) != tuple(kc.shape[2:]) or kc.shape[:-1] != vc.shape[:-1]:
        raise _fail(op, f"key {list(key.shape)} does not fit the cache {list(kc.shape)}")
    if tuple(value.shape[1:]) != tuple(vc.shape[2:]):
        raise _fail(op, f"value {list(value.shape)} does not fit the cache {list(vc.shape)}")
    if kc.stride(0) != vc.stride(0):
        raise _fail(
            op,
            f"key_cache.stride(0) {kc.stride(0)} != value_cache.stride(0) {vc.stride(0)} "
            "(TORCH_CHECK(key_cache.stride(0) == value_cache.stride(0)))",
        )
    if kc.stride() != vc.stride():
        raise _fail(
            op,
            f"value_cache strides {list(vc.stride())} differ from key_cache's "
            f"{list(kc.stride())}: the kernel indexes both with key_cache's strides",
        )
    for name, src in (("key", key), ("value", value)):
        head_size = src.shape[2]
        if src.shape[1] > 1 and src.stride(1) != head_size:
            raise _fail(
                op,
                f"{name} rows must hold their heads densely (stride(1) == head_size "
                f"{head_size}), got strides {list(src.stride())}",
            )
    num_slots = kc.shape[0] * kc.shape[1]
    valid = slots >= 0  # padding is skipped
    if bool((slots[valid] >= num_slots).any()):
        bad = int(slots[valid].max())
        raise _fail(op, f"slot_mapping holds {bad}, outside the cache ({num_slots} slots)")
    return kc, vc, slots, valid, fp8


def _to_fp8_bytes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's fp8 store: ``x / scale`` in float32, converted to e4m3 saturating at +-448
    (``__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)``) [source:
    csrc/quantization/fp8/nvidia/quant_utils.cuh], as bytes."""
    return (x.float() / scale.float()).clamp(-448.0, 448.0).to(FP8).view(torch.uint8)


@emulation.kernel(null=emulation.skip)
def _write_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    fp8_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """``reshape_and_cache_flash``'s write, every argument checked by it."""
    rows = torch.nonzero(valid).flatten()
    targets = slots[rows]
    block, offset = targets // kc.shape[1], targets % kc.shape[1]  # strided planes: no view
    if fp8_scales is None:
        kc[block, offset] = key[rows]
        vc[block, offset] = value[rows]
        return
    for plane, src, scale in ((kc, key, fp8_scales[0]), (vc, value, fp8_scales[1])):
        plane.view(torch.uint8)[block, offset] = _to_fp8_bytes(src[rows], scale)


def concat_and_cache_mla(  # vllm._custom_ops
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    """vLLM's MLA cache write (``MLACommonImpl.do_kv_cache_update``, what FLASH_ATTN_MLA's
    cache gets): token ``t``'s ``kv_c`` then its ``k_pe`` into one entry of the joint cache
    [num_blocks, block_size, kv_lora_rank + pe_dim] at slot ``slot_mapping[t]``, for the
    ``slot_mapping.size(0)`` first tokens (kv_c may hold more rows: padding); a slot < 0 is
    skipped [source: csrc/cache_kernels.cu ``concat_and_cache_mla``: ``TORCH_CHECK(
    kv_cache.size(2) == kv_lora_rank + pe_dim)``, sources read through ``kv_c.stride(0)`` /
    ``k_pe.stride(0)``, the cache through its block and entry strides]. The slots are read
    through a raw int64 pointer, so a strided or int32 mapping is refused as for
    ``reshape_and_cache_flash`` [inferred]. ``kv_cache_dtype`` "auto" (the model dtype) and
    "fp8" / "fp8_e4m3" (FLASHMLA's fp8 cache: each element of ``kv_c`` and ``k_pe`` stored as
    ``fp8::scaled_convert(x, *scale)``, e4m3 of ``x / scale`` saturated at +-448, into a cache
    of bytes, uint8 as vLLM allocates it or a float8_e4m3fn view) are emulated; "fp8_e5m2" is
    valid but not emulated."""
    op = "_custom_ops.concat_and_cache_mla"
    if not isinstance(kv_c, torch.Tensor):
        raise _fail(op, f"kv_c must be a Tensor, got {type(kv_c).__name__}")
    dev = kv_c.device
    c = _tensor(op, "kv_c", kv_c, 2, dev)
    pe = _tensor(op, "k_pe", k_pe, 2, dev)
    cache = _tensor(op, "kv_cache", kv_cache, 3, dev)
    slots = _tensor(op, "slot_mapping", slot_mapping, 1, dev, contiguous=True)
    if slots.dtype != torch.int64:
        raise _fail(op, f"slot_mapping must be int64, got {slots.dtype}")
    fp8 = kv_cache_dtype in ("fp8", "fp8_e4m3")
    if kv_cache_dtype != "auto" and not fp8:
        raise NotEmulatedError(f"{op}: kv_cache_dtype {kv_cache_dtype!r} is not emulated")
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise _fail(op, "scale must be a one-element tensor")
    rank, pe_dim = c.shape[1], pe.shape[1]
    if cache.shape[2] != rank + pe_dim:
        raise _fail(
            op, f"kv_cache.size(2) = {cache.shape[2]} != kv_lora_rank + pe_dim = {rank + pe_dim}"
        )
    if fp8:
        # the kernel reinterprets the cache's bytes as e4m3 and reads kv_c / k_pe as the model
        # dtype, the scale as float32 [source: DISPATCH_BY_KV_CACHE_DTYPE]
        if cache.dtype not in (torch.uint8, FP8):
            raise _fail(op, f"kv_cache must hold bytes (uint8 or fp8) for fp8, got {cache.dtype}")
        if c.dtype not in (torch.float32, *MODEL_DTYPES) or pe.dtype != c.dtype:
            raise _fail(op, f"kv_c / k_pe must be float32, fp16 or bf16, got {c.dtype}, {pe.dtype}")
        if scale.dtype != torch.float32:
            raise _fail(op, f"scale must be float32 for fp8, got {scale.dtype}")
    elif c.dtype != cache.dtype or pe.dtype != cache.dtype:
        raise _fail(
            op, f"kv_c {c.dtype} / k_pe {pe.dtype} and the cache {cache.dtype} differ ('auto')"
        )
    n = slots.shape[0]
    if c.shape[0] < n or pe.shape[0] < n:
        raise _fail(op, f"kv_c / k_pe have fewer rows than slot_mapping ({n})")
    num_slots = cache.shape[0] * cache.shape[1]
    valid = slots >= 0
    if bool((slots[valid] >= num_slots).any()):
        bad = int(slots[valid].max())
        raise _fail(op, f"slot_mapping holds {bad}, outside the cache ({num_slots} slots)")
    _write_latent(c, pe, cache, slots, valid, scale if fp8 else None)


@emulation.kernel(null=emulation.skip)
def _write_latent(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    fp8_scale: torch.Tensor | None,
) -> None:
    """``concat_and_cache_mla``'s write, every argument checked by it."""
    rows = torch.nonzero(valid).flatten()
    targets = slots[rows]
    block, offset = targets // cache.shape[1], targets % cache.shape[1]
    entries = torch.cat([kv_c[rows], k_pe[rows]], dim=-1)
    if fp8_scale is None:
        cache[block, offset] = entries
    else:
        cache.view(torch.uint8)[block, offset] = _to_fp8_bytes(entries, fp8_scale)


# --- upstream FA2: flash_attn ------------------------------------------------------------------

_FA2_RULES = _Rules(
    "flash_attn (FA2)",
    lambda d: d % 8 == 0 and d <= 256,
    "head sizes up to 256 (multiples of 8 without padding the cache)",
    256,
    math.inf,
    causal_alibi_column_bias=True,
)


def fa2_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """FA2 ``flash_attn_varlen_func``: with ``block_table``, K/V are the paged cache and
    ``cu_seqlens_k`` holds the cumulative KV lengths [inferred: flash_api.cpp reads seqlen_k
    from cu_seqlens_k for paged varlen]. Returns ``out``; ``(out, lse, S_dmask)`` with
    ``return_attn_probs``, S_dmask an empty tensor without dropout [source]."""
    op = "flash_attn.flash_attn_varlen_func"
    _not_emulated(op, dropout_p=dropout_p or None)
    paged = block_table is not None
    q, k, v = _check_qkv(op, _FA2_RULES, q, k, v, paged=paged)
    dev = q.device
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise _fail(op, "cu_seqlens_q must be a Tensor")
    batch = cu_seqlens_q.shape[0] - 1
    q_starts = _int32(op, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), dev)
    q_lens = _cumulative(op, "cu_seqlens_q", q_starts, q.shape[0])
    kv_starts = _int32(op, "cu_seqlens_k", cu_seqlens_k, (batch + 1,), dev)
    kv_lens = _cumulative(op, "cu_seqlens_k", kv_starts, None if paged else k.shape[0])
    _max_covers(op, "max_seqlen_q", max_seqlen_q, q_lens)
    _max_covers(op, "max_seqlen_k", max_seqlen_k, kv_lens)
    args: dict[str, Any] = dict(
        scale=q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale),
        window=_window(op, window_size, bool(causal), none_is_unbounded=False),
        softcap=_softcap(op, softcap),
        slopes=_alibi(op, alibi_slopes, q.shape[1], batch, dev),
        sink=None,
    )
    args["causal_branch"] = _fa2_causal_branch(args["window"], int(max_seqlen_k))
    if paged:
        res, lse = _paged_call(op, _FA2_RULES, q, k, v, q_starts, kv_lens, block_table, **args)
    else:
        res, lse = _varlen(op, _FA2_RULES, q, k, v, q_starts, kv_lens, kv_starts, None, **args)
    out = res.to(q.dtype)
    if not return_attn_probs:
        return out
    # S_dmask without dropout: ``p = torch::empty({0}, opts)`` (q's dtype) [source:
    # flash_api.cpp mha_varlen_fwd], returned as it is by the Python wrapper
    return out, lse, torch.empty(0, dtype=q.dtype, device=q.device)


def _padded_batch_call(
    op: str,
    rules: _Rules,
    q: object,  # [B, Sq, H, D]
    k_cache: object,
    v_cache: object,
    cache_seqlens: object,
    table: object,
    table_name: str,
    *,
    fp8: bool = False,  # FA3: fp8 e4m3 inputs with descales
    descales: tuple[object, object, object] = (None, None, None),
    **math_args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Sq, H, D] q dtype, lse [B, H, Sq]
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise _fail(op, "q must be a 4-D Tensor (batch_size, seqlen, nheads, headdim)")
    batch, seqlen = q.shape[:2]
    flat = q.reshape(batch * seqlen, *q.shape[2:])
    qf, kc, vc = _check_qkv(op, rules, flat, k_cache, v_cache, paged=True, fp8=fp8)
    math_args["descale"] = _descales(op, qf, batch, kc.shape[-2], *descales)
    if table is None:
        raise NotEmulatedError(f"{op}: a contiguous (non-paged) cache is not emulated")
    if isinstance(cache_seqlens, int):
        kv_lens = [cache_seqlens] * batch
    else:
        kv_lens = _int32(op, "cache_seqlens", cache_seqlens, (batch,), q.device)
    starts = [b * seqlen for b in range(batch + 1)]
    t = _tensor(op, table_name, table, 2, q.device)
    if t.dtype != torch.int32:
        raise _fail(op, f"{table_name} must have dtype torch.int32, got {t.dtype}")
    if rules.causal_alibi_column_bias:  # kvcache's seqlen_k: the table's capacity [source]
        math_args["causal_branch"] = _fa2_causal_branch(
            math_args["window"], t.shape[1] * kc.shape[1]
        )
    res, lse = _paged_call(op, rules, qf, kc, vc, starts, kv_lens, t, **math_args)
    out = res.to(_out_dtype(qf)).view(batch, seqlen, q.shape[2], vc.shape[-1])
    # (H, B * Sq) -> (B, H, Sq)
    return out, lse.view(-1, batch, seqlen).permute(1, 0, 2).contiguous()


def fa2_flash_attn_with_kvcache(  # type: ignore[no-untyped-def]
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,  # noqa: UP007, UP045
    cache_batch_idx: Optional[torch.Tensor] = None,  # noqa: UP045
    cache_leftpad: Optional[torch.Tensor] = None,  # noqa: UP045
    block_table: Optional[torch.Tensor] = None,  # noqa: UP045
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """FA2 ``flash_attn_with_kvcache``: q (batch, seqlen, nheads, headdim) over a paged cache of
    ``cache_seqlens`` keys; LSE (batch, nheads, seqlen)."""
    op = "flash_attn.flash_attn_with_kvcache"
    _not_emulated(
        op,
        k=k,
        v=v,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
    )
    if cache_seqlens is None:
        raise NotEmulatedError(f"{op}: cache_seqlens=None (whole cache) is not emulated")
    batch = q.shape[0] if isinstance(q, torch.Tensor) else 0
    dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    heads = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    out, lse = _padded_batch_call(
        op,
        _FA2_RULES,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        block_table,
        "block_table",
        scale=(q.shape[-1] ** -0.5) if softmax_scale is None else float(softmax_scale),
        window=_window(op, window_size, bool(causal), none_is_unbounded=False),
        softcap=_softcap(op, softcap),
        slopes=_alibi(op, alibi_slopes, heads, batch, dev),
        sink=None,
    )
    return (out, lse) if return_softmax_lse else out


# --- FA3 (hopper): flash_attn_interface --------------------------------------------------------

_FA3_RULES = _Rules(
    "flash_attn_interface (FA3)",
    lambda d: d % 8 == 0 and d <= 256,
    "head sizes that are multiples of 8 up to 256",
    1,  # "page_block_size can be arbitrary" [doc]
    -math.inf,  # hopper softmax.h finalize / epilogue store_zero [source]
    empty_sequence_drops_sink=True,  # no sinks in 2.8.3's interface: never reached
    head_size_v=_fa3_head_size_v,
)


def fa3_flash_attn_with_kvcache(  # type: ignore[no-untyped-def]
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[(int, torch.Tensor)]] = None,  # noqa: UP007, UP045
    cache_batch_idx: Optional[torch.Tensor] = None,  # noqa: UP045
    cache_leftpad: Optional[torch.Tensor] = None,  # noqa: UP045
    page_table: Optional[torch.Tensor] = None,  # noqa: UP045
    cu_seqlens_q: Optional[torch.Tensor] = None,  # noqa: UP045
    cu_seqlens_k_new: Optional[torch.Tensor] = None,  # noqa: UP045
    max_seqlen_q: Optional[int] = None,  # noqa: UP045
    rotary_seqlens: Optional[torch.Tensor] = None,  # noqa: UP045
    q_descale: Optional[torch.Tensor] = None,  # noqa: UP045
    k_descale: Optional[torch.Tensor] = None,  # noqa: UP045
    v_descale: Optional[torch.Tensor] = None,  # noqa: UP045
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """FA3 ``flash_attn_with_kvcache``: paged through ``page_table``; with ``cu_seqlens_q`` and
    ``max_seqlen_q``, q is varlen (total_q, nheads, headdim) and the LSE (nheads, total_q)
    [inferred: the varlen forward's shapes]; else q (batch, seqlen, nheads, headdim)."""
    op = "flash_attn_interface.flash_attn_with_kvcache"
    _not_emulated(
        op,
        k=k,
        v=v,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        cu_seqlens_k_new=cu_seqlens_k_new,
        rotary_seqlens=rotary_seqlens,
        attention_chunk=attention_chunk or None,
        scheduler_metadata=scheduler_metadata,
    )
    descales = (q_descale, k_descale, v_descale)
    if cache_seqlens is None:
        raise NotEmulatedError(f"{op}: cache_seqlens=None (whole cache) is not emulated")
    if page_table is None:
        raise NotEmulatedError(f"{op}: a contiguous (non-paged) cache is not emulated")
    math_args: dict[str, Any] = dict(
        window=_window(op, window_size, bool(causal), none_is_unbounded=False),
        softcap=_softcap(op, softcap),
        slopes=None,
        sink=None,
    )
    if qv is not None and cu_seqlens_q is None:
        raise NotEmulatedError(f"{op}: qv with a padded-batch q is not emulated (varlen q is)")
    if cu_seqlens_q is None:
        math_args["scale"] = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        out, lse = _padded_batch_call(
            op,
            _FA3_RULES,
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            page_table,
            "page_table",
            fp8=True,
            descales=descales,
            **math_args,
        )
        return (out, lse, *_fa3_rest()) if return_softmax_lse else out
    out, lse = _fa3_varlen_call(
        op,
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        max_seqlen_q,
        cache_seqlens,
        page_table,
        softmax_scale,
        descales,
        qv=qv,
        **math_args,
    )
    return (out, lse, *_fa3_rest()) if return_softmax_lse else out


def _fa3_varlen_call(
    op: str,
    q: object,
    k_cache: object,
    v_cache: object,
    cu_seqlens_q: object,
    max_seqlen_q: object,
    cache_seqlens: int | torch.Tensor,
    page_table: torch.Tensor,
    softmax_scale: float | None,
    descales: tuple[object, object, object],
    qv: object = None,
    **math_args: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's varlen q (``cu_seqlens_q`` + ``max_seqlen_q``) on a paged cache: the lengths
    checked, the output in q's output dtype and the LSE (nheads, total_q). With ``qv`` (the
    value query, ``_check_qv``) the default scale is ``(q + qv head sizes) ** -0.5`` [schema]."""
    if max_seqlen_q is None:
        raise _fail(op, "max_seqlen_q must be given with cu_seqlens_q")
    if qv is not None:
        qq, kc, vc, qv_t = _check_qv(op, _FA3_RULES, "qv", q, k_cache, v_cache, qv)
        math_args["qv"] = qv_t
        if softmax_scale is None:
            softmax_scale = (qq.shape[-1] + qv_t.shape[-1]) ** -0.5
    else:
        qq, kc, vc = _check_qkv(op, _FA3_RULES, q, k_cache, v_cache, paged=True, fp8=True)
    dev = qq.device
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise _fail(op, "cu_seqlens_q must be a Tensor")
    batch = cu_seqlens_q.shape[0] - 1
    q_starts = _int32(op, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), dev)
    q_lens = _cumulative(op, "cu_seqlens_q", q_starts, qq.shape[0])
    _max_covers(op, "max_seqlen_q", max_seqlen_q, q_lens)
    if isinstance(cache_seqlens, int):
        kv_lens = [cache_seqlens] * batch
    else:
        kv_lens = _int32(op, "cache_seqlens", cache_seqlens, (batch,), dev)
    math_args["scale"] = qq.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    math_args["descale"] = _descales(op, qq, batch, kc.shape[-2], *descales)
    res, lse = _paged_call(op, _FA3_RULES, qq, kc, vc, q_starts, kv_lens, page_table, **math_args)
    return res.to(_out_dtype(qq)), lse


def _fa3_rest() -> tuple[torch.Tensor, torch.Tensor]:
    """What FA3's ``flash_attn_with_kvcache`` returns after (out, softmax_lse) with
    ``return_softmax_lse`` (``return (out, softmax_lse, *rest)`` [schema]): the split-KV
    accumulators of the C++ forward, empty here (no split) [inferred]."""
    return torch.empty(0), torch.empty(0)


# --- FA4: flash_attn.cute ----------------------------------------------------------------------


def _fa4_head_dims_ok(arch: int, head_dim: int, head_dim_v: int) -> bool:
    """``_validate_head_dims`` for 16-bit dtypes (alignment 8) [source: flash-attn-4 4.0.0b36
    interface.py]: SM90 any pair in 8..256; SM100/110 both in 8..128, or (192, 128)
    (DeepSeek), (64, 512) or (d, d) with d = 512 (MLA's absorbed shape), (256, 256)."""
    aligned = head_dim % 8 == 0 and head_dim_v % 8 == 0
    if arch // 10 == 9:
        return aligned and 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256
    return aligned and (
        (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128)
        or (head_dim, head_dim_v) == (192, 128)
        or ((head_dim == 64 or head_dim == head_dim_v) and head_dim_v == 512)
        or (head_dim, head_dim_v) == (256, 256)
    )


def _fa4_head_size_v(arch: int) -> Callable[[str, int, int, torch.dtype], None]:
    """FA4's check of a (head_dim, head_dim_v) pair on ``arch`` (``_validate_head_dims``)."""

    def check(op: str, head_size: int, head_size_v: int, dtype: torch.dtype) -> None:
        if not _fa4_head_dims_ok(arch, head_size, head_size_v):
            raise _fail(
                op,
                f"(head_dim, head_dim_v)=({head_size}, {head_size_v}) is not supported on "
                f"SM{arch} (_validate_head_dims)",
            )
        if head_size_v == 512:
            # the MLA absorbed shape: the interface routes it to its MLA kernels with qv
            # ('assert head_dim_v == 512' there) [source]
            raise NotEmulatedError(
                f"{op}: head_dim_v 512 without qv (MLA's absorbed shape) is not emulated"
            )

    return check


def _fa4_rules(arch: int) -> _Rules:
    """FA4's rules on ``arch`` (``_validate_head_dims``, 16-bit dtypes: alignment 8) [source:
    flash-attn-4 4.0.0b36 interface.py]."""
    if arch // 10 == 9:
        return _Rules(
            "flash_attn.cute (FA4, SM90)",
            lambda d: 8 <= d <= 256 and d % 8 == 0,
            "8..256 in multiples of 8 on SM90 (_validate_head_dims)",
            1,  # any page size; the key tile is the TMA path [schema]
            -math.inf,  # empty rows: lse.fill_(-inf) [schema]
            head_size_v=_fa4_head_size_v(arch),
        )
    return _Rules(
        "flash_attn.cute (FA4)",
        lambda d: (8 <= d <= 128 and d % 8 == 0) or d == 256,
        f"8..128 in multiples of 8, or 256 on SM{arch} (_validate_head_dims)",
        1,
        -math.inf,
        head_size_v=_fa4_head_size_v(arch),
    )


def _fa4_tile_n(arch: int, head_dim: int, head_dim_v: int, *, causal: bool, local: bool) -> int:
    """FA4's key tile: ``FwdConfig(128, 128)`` (SM100/110, SM120 head <= 64), SM120 head > 64
    64, SM90 ``_tile_size_fwd_sm90`` [source]."""
    if arch // 10 == 12:
        return 128 if head_dim <= 64 else 64
    if arch // 10 != 9:
        return 128
    if head_dim <= 64 or 96 < head_dim <= 128:
        return 128
    if head_dim <= 96:
        return 128 if causal or local else 144
    if head_dim <= 192:
        return 96 if local else (128 if head_dim_v <= 128 else 112)
    return 64 if local else 80


def _fa4_causal_local(causal: bool, window: tuple[Any, Any]) -> tuple[bool, bool]:
    """``_resolve_causal_local_window`` (no mask_mod): (causal, local) [source]."""
    left, right = window
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is not None or right is not None:
        if left is None and right == 0:
            return True, False
        return False, True
    return causal, False


def fa4_flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qv: Optional[torch.Tensor] = None,  # noqa: UP045
    cu_seqlens_q: Optional[torch.Tensor] = None,  # noqa: UP045
    cu_seqlens_k: Optional[torch.Tensor] = None,  # noqa: UP045
    max_seqlen_q: Optional[int] = None,  # noqa: UP045
    max_seqlen_k: Optional[int] = None,  # noqa: UP045
    min_seqlen_k: Optional[int] = None,  # noqa: UP045
    seqused_q: Optional[torch.Tensor] = None,  # noqa: UP045
    seqused_k: Optional[torch.Tensor] = None,  # noqa: UP045
    gather_kv_indices: Optional[torch.Tensor] = None,  # noqa: UP045
    page_table: Optional[torch.Tensor] = None,  # noqa: UP045
    softmax_scale: Optional[float] = None,  # noqa: UP045
    causal: bool = False,
    window_size: tuple[Optional[int], Optional[int]] = (None, None),  # noqa: UP045
    learnable_sink: Optional[torch.Tensor] = None,  # noqa: UP045
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: Optional[bool] = None,  # noqa: UP045
    deterministic: bool = False,
    score_mod: Optional[Callable[..., Any]] = None,  # noqa: UP045
    score_mod_bwd: Optional[Callable[..., Any]] = None,  # noqa: UP045
    mask_mod: Optional[Callable[..., Any]] = None,  # noqa: UP045
    block_sparse_tensors: Optional[Any] = None,  # noqa: UP045
    aux_tensors: Optional[list[Any]] = None,  # noqa: UP045
    aux_scalars: Optional[tuple[Any, ...]] = None,  # noqa: UP045
    return_lse: bool = False,
    scheduler_metadata: Optional[Any] = None,  # noqa: UP045
    seqlen_k_per_split: Optional[int] = None,  # noqa: UP045
    disable_scheduler_metadata: bool = False,
    gather_bwd_recompute_p: bool = False,
    gather_bwd_token_chunk: Optional[int] = None,  # noqa: UP045
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FA4 ``flash_attn_varlen_func``: paged through ``page_table`` + ``seqused_k`` (page_table
    with cu_seqlens_k is rejected [schema]); returns ``(out, lse)``, lse None unless
    ``return_lse`` [schema]."""
    op = "flash_attn.cute.flash_attn_varlen_func"
    _not_emulated(
        op,
        min_seqlen_k=min_seqlen_k,
        seqused_q=seqused_q,
        gather_kv_indices=gather_kv_indices,
        score_mod=score_mod,
        score_mod_bwd=score_mod_bwd,
        mask_mod=mask_mod,
        block_sparse_tensors=block_sparse_tensors,
        aux_tensors=aux_tensors,
        aux_scalars=aux_scalars,
        scheduler_metadata=scheduler_metadata,
        seqlen_k_per_split=seqlen_k_per_split,
    )
    paged = page_table is not None
    arch = _check_fa4_inputs(op, cu_seqlens_q, cu_seqlens_k, seqused_k, paged=paged)
    rules = _fa4_rules(arch)
    qv_t = None
    if qv is not None:
        q, k, v, qv_t = _check_fa4_qv(op, arch, q, k, v, qv, bool(causal), window_size, paged)
    else:
        q, k, v = _check_qkv(op, rules, q, k, v, paged=paged)
    if paged:
        _check_fa4_paged_head_dim(op, arch, q, k, v, bool(causal), window_size)
    q_starts, q_lens, kv_starts, kv_lens = _varlen_lengths(
        op, q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, paged=paged, table="page_table"
    )
    # max lengths are optional hints for FA4 [doc]; given ones must cover the batch
    if max_seqlen_q is not None:
        _max_covers(op, "max_seqlen_q", max_seqlen_q, q_lens)
    if max_seqlen_k is not None:
        _max_covers(op, "max_seqlen_k", max_seqlen_k, kv_lens)
    sink = None if learnable_sink is None else _fa4_sink(op, learnable_sink, q)
    # the default scale: q's head dim, or with qv q's and qv's together [schema]
    dims = q.shape[-1] + (0 if qv_t is None else v.shape[-1])
    args: dict[str, Any] = dict(
        scale=dims**-0.5 if softmax_scale is None else float(softmax_scale),
        window=_window(op, window_size, bool(causal), none_is_unbounded=True),
        softcap=_softcap(op, softcap),
        slopes=None,
        sink=sink,
    )
    if qv_t is not None:
        args["qv"] = qv_t
    if paged:
        res, lse = _paged_call(op, rules, q, k, v, q_starts, kv_lens, page_table, **args)
    else:
        res, lse = _varlen(op, rules, q, k, v, q_starts, kv_lens, kv_starts, None, **args)
    if qv_t is not None:  # with qv the LSE is (total_q, nheads): "nheads as the contiguous
        lse = lse.t().contiguous()  # mode" [doc]
    return res.to(q.dtype), (lse if return_lse else None)


#: FA4's value query [source: flash-attn-4 4.0.0b36 interface.py, _flash_attn_fwd]: MLA's
#: absorbed shape only (q/k head dim 64, v and qv 512), on Blackwell.
FA4_QV_HEAD_DIMS = (64, 512)


def _check_fa4_qv(
    op: str,
    arch: int,
    q: object,
    k: object,
    v: object,
    qv: object,
    causal: bool,
    window_size: tuple[int | None, int | None] | None,
    paged: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call with FA4's ``qv`` (``O = softmax(scale * (Q @ K.T + Qv @ V.T)) @ V`` [doc]), as
    ``_flash_attn_fwd`` checks it, in its order [source]: one dtype for q, k, v and qv, fp16 or
    bf16 here (its fp8 MLA path is not emulated); ``_validate_head_dims`` (SM90: head_dim_v
    <= 256); "only support Blackwell arch with qv"; qv shaped as q but for v's head dim;
    head_dim_v 512 and head_dim 64; no local window. The interface routes such a call to its
    MLA kernels (1CTA or 2CTA, by ``_mla_1cta_route``); the math is theirs alike."""
    if not isinstance(q, torch.Tensor):
        raise NotEmulatedError(f"{op}: q=None (qv alone) is not emulated")
    if not paged:
        raise NotEmulatedError(f"{op}: qv without page_table is not emulated")
    dev = q.device
    q = _tensor(op, "q", q, 3, dev)
    k = _tensor(op, "k", k, 4, dev)
    v = _tensor(op, "v", v, 4, dev)
    qv = _tensor(op, "qv", qv, 3, dev)
    if v.dtype not in MODEL_DTYPES:
        if v.dtype in (FP8, torch.float8_e5m2):
            raise NotEmulatedError(f"{op}: fp8 inputs with qv are not emulated")
        raise AssertionError("inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2")
    if any(t.dtype != v.dtype for t in (q, k, qv)):
        raise AssertionError("q, k, v, and qv must have the same dtype")
    if k.shape[:-1] != v.shape[:-1]:
        raise AssertionError(f"k {list(k.shape)} and v {list(v.shape)} must agree but for hdim")
    num_heads, head_dim = q.shape[1:]
    head_dim_v = v.shape[-1]
    if num_heads % v.shape[-2]:
        raise AssertionError("num_head must be divisible by num_head_kv")
    if not _fa4_head_dims_ok(arch, head_dim, head_dim_v):
        raise _fail(
            op,
            f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on "
            f"SM{arch} (_validate_head_dims)",
        )
    if arch // 10 not in (10, 11):
        raise AssertionError("only support Blackwell arch with qv")
    if qv.shape[:-1] != q.shape[:-1] or qv.shape[-1] != head_dim_v:
        raise AssertionError(
            f"qv must have shape {[*q.shape[:-1], head_dim_v]}, got {list(qv.shape)}"
        )
    if (head_dim, head_dim_v) != FA4_QV_HEAD_DIMS:
        raise AssertionError(
            f"qv takes head_dim 64 and head_dim_v 512, got {head_dim} and {head_dim_v}"
        )
    pair: Any = (None, None) if window_size is None else tuple(window_size)
    if _fa4_causal_local(causal, pair)[1]:
        raise AssertionError("local not yet supported with qv")
    return q, k, v, qv


def _check_fa4_inputs(
    op: str, cu_seqlens_q: object, cu_seqlens_k: object, seqused_k: object, *, paged: bool
) -> int:
    """Which of FA4's ways of giving the lengths are emulated, and which the kernel refuses
    [schema]; returns the architecture the call runs as."""
    if cu_seqlens_q is None:
        raise NotEmulatedError(f"{op}: batched (non-varlen) q is not emulated")
    if paged and cu_seqlens_k is not None:
        raise AssertionError("page_table is not supported with cu_seqlens_k")
    if cu_seqlens_k is None and seqused_k is None:
        raise NotEmulatedError(f"{op}: K/V without cu_seqlens_k or seqused_k is not emulated")
    arch = fa4_arch()
    if paged and arch // 10 == 12:
        raise AssertionError("Paged KV not supported on SM 12.0 in this PR")
    return arch


def _check_fa4_paged_head_dim(
    op: str,
    arch: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window_size: tuple[int | None, int | None] | None,
) -> None:
    """A head dim (or head_dim_v) that is not a multiple of 16 is padded by the kernel
    (``check_hdim_oob`` / ``check_hdim_v_oob``) [source]; a paged read of such heads needs a
    page of exactly one K tile (else the non-TMA path refuses it)."""
    if q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0:
        return
    pair: Any = (None, None) if window_size is None else tuple(window_size)
    causal_, local = _fa4_causal_local(causal, pair)
    tile_n = _fa4_tile_n(arch, q.shape[-1], v.shape[-1], causal=causal_, local=local)
    if k.shape[1] != tile_n:  # a non-TMA paged read ("paged_kv_non_tma")
        raise AssertionError("Paged KV does not support irregular head dim")


def _fa4_sink(op: str, learnable_sink: object, q: torch.Tensor) -> torch.Tensor:
    """FA4's ``learnable_sink``: one logit per query head, a float dtype [schema]."""
    sink = _tensor(op, "learnable_sink", learnable_sink, 1, q.device)
    if tuple(sink.shape) != (q.shape[1],):
        raise AssertionError("learnable_sink.shape == (num_head,)")
    if sink.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise AssertionError("learnable_sink must be float16, bfloat16, or float32")
    return sink


# --- FlashMLA: vLLM's vllm.v1.attention.ops.flashmla (dense decode) ----------------------------
# vLLM 0.33's ops/flashmla.py re-exports ``get_mla_metadata``, ``flash_mla_with_kvcache`` and
# ``FlashMLASchedMeta`` from ``vllm/third_party/flashmla/flash_mla_interface.py`` (FlashMLA's
# Python interface, vendored), whose dense path calls ``torch.ops._flashmla_C.dense_decode_fwd``
# (FlashMLA's csrc/api/dense_decode: the SM90 kernel ``sm90::decode::dense``) [source].

#: The SM90 dense decode kernel's shapes: ``Config::PAGE_BLOCK_SIZE = 64``, ``HEAD_DIM_K =
#: 576``, ``HEAD_DIM_V = 512`` (``run_flash_splitkv_mla_kernel`` asserts ``params.d ==
#: HEAD_DIM_K``, though the interface's check lets 512 through) [source].
FLASHMLA_PAGE_BLOCK_SIZE = 64
FLASHMLA_HEAD_DIM = 576
FLASHMLA_HEAD_DIM_V = 512
#: The scheduler's row tile (``Config::BLOCK_SIZE_M``) and the emulated GPU's SM count (an H100
#: or H200 SXM: 132), which size ``tile_scheduler_metadata`` as ``num_sm_parts x 8`` [source:
#: dense_decode ``num_sm_parts``; the SM count inferred].
_FLASHMLA_BLOCK_M = 64
_FLASHMLA_NUM_SMS = 132
_FLASHMLA_SCHED_META_INTS = 8  # sizeof(DecodingSchedMeta) / 4


@dataclass
class FlashMLASchedMeta:
    """FlashMLA's tile scheduler metadata, as its interface defines it: empty from
    ``get_mla_metadata``, filled by the first ``flash_mla_with_kvcache`` call that takes it
    (``config`` and the kernel's ``tile_scheduler_metadata`` / ``num_splits``), checked by
    every later call [source]."""

    @dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int

        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]  # noqa: UP045 (the vendor's annotation)

        extra_page_block_size: Optional[int]  # noqa: UP045
        extra_topk: Optional[int]  # noqa: UP045

        enable_batch_invariant: bool

    have_initialized: bool = False

    config: Optional[Config] = None  # noqa: UP045

    tile_scheduler_metadata: Optional[torch.Tensor] = None  # noqa: UP045
    num_splits: Optional[torch.Tensor] = None  # noqa: UP045


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:  # type: ignore[no-untyped-def]
    """An empty ``FlashMLASchedMeta`` (the arguments are ignored: "we keep *args and **kwargs
    to be compatible with the old interface"); the schedule is made by the first call that
    takes it [doc]."""
    return FlashMLASchedMeta(), None


def _flashmla_num_sm_parts(s_q: int, h_q: int, h_k: int) -> int:
    """dense_decode's ``max(num_sms / h_k / ceil_div(s_q * h_q / h_k, 64), 1)`` [source]."""
    return max(_FLASHMLA_NUM_SMS // h_k // -(-(s_q * h_q // h_k) // _FLASHMLA_BLOCK_M), 1)


def _flashmla_check_config(meta: FlashMLASchedMeta, cfg: FlashMLASchedMeta.Config) -> None:
    """The interface's checks of a reused ``sched_meta`` against this call, in its order."""
    assert meta.config is not None
    help_ = (
        " Your input arguments are inconsistent with sched_meta. Please make sure the input "
        "arguments are consistent across different invocations of flash_mla_with_kvcache on "
        "the same sched_meta."
    )
    for name, what in (
        ("b", "batch_size"),
        ("s_q", "seq_len_q"),
        ("h_q", "num_heads_q"),
        ("page_block_size", "page_block_size"),
        ("h_k", "num_heads_k"),
        ("causal", "causal"),
        ("is_fp8_kvcache", "is_fp8_kvcache"),
        ("topk", "the last dim of indices_in_kvcache"),
        ("extra_page_block_size", "the page_block_size of extra_k_cache"),
        ("extra_topk", "the last dim of extra_indices_in_kvcache"),
        ("enable_batch_invariant", "enable_batch_invariant"),
    ):
        if getattr(meta.config, name) != getattr(cfg, name):
            raise AssertionError(f"sched_meta.config.{name} must be equal to {what}." + help_)


def flash_mla_with_kvcache(  # FlashMLA's interface (vLLM 0.33)
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],  # noqa: UP045
    cache_seqlens: Optional[torch.Tensor],  # noqa: UP045
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: Optional[float] = None,  # noqa: UP045
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,  # noqa: UP045
    attn_sink: Optional[torch.Tensor] = None,  # noqa: UP045
    extra_k_cache: Optional[torch.Tensor] = None,  # noqa: UP045
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,  # noqa: UP045
    topk_length: Optional[torch.Tensor] = None,  # noqa: UP045
    extra_topk_length: Optional[torch.Tensor] = None,  # noqa: UP045
    out: Optional[torch.Tensor] = None,  # noqa: UP045
    enable_batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense decode, as vLLM's FLASHMLA backend calls it (``forward_mqa``: q
    ``(batch, seq_len_q, num_heads_q, 576)`` = ``[q_nope @ W_UK ; q_pe]``, k_cache the joint
    latent plane ``(num_blocks, 64, 1, 576)``, ``head_dim_v`` = kv_lora_rank = 512, causal):
    multi-query attention over keys ``k_cache[..., :576]`` with values ``k_cache[..., :512]``,
    causal bottom-right (query i of s_q sees ``seqlen_k - (s_q - 1 - i)`` keys: the kernel's
    ``get_mask_len``; with s_q = 1 the kernel drops ``causal``) [source: flash_mla_interface.py,
    csrc/api/dense_decode, sm90/decode/dense/splitkv_mla.cuh].

    Returns ``out (batch, seq_len_q, num_heads_q, 512)`` in q's dtype and ``softmax_lse
    (batch, num_heads_q, seq_len_q)`` float32, natural log; a row that sees no key: output 0,
    LSE +inf (``cur_L == 0 ? INFINITY``) [source]. Checks, as the interface asserts
    (AssertionError) and the kernel checks (FlashOpError) [source]: the sched_meta's type and
    its config on reuse; ``num_splits`` None; block_table and cache_seqlens given; q fp16 /
    bf16, k_cache of q's dtype; int32 lengths and table; contiguous last dims (lengths
    contiguous); head_size_k 576 (the interface also lets 512 through, which the SM90 kernel's
    ``FLASH_ASSERT(params.d == HEAD_DIM_K)`` refuses); head_dim_v 512; page_block_size 64;
    batch_size > 0; num_heads_k dividing num_heads_q; the shapes of k_cache, cache_seqlens,
    block_table and (reused) the schedule. The block table's pages must lie in the cache and a
    reused schedule must have been made for these lengths (the kernel would read outside the
    cache, or run a stale schedule: undefined there) [inferred]. The sparse path (``indices``
    and the arguments with it), ``out=`` and fp8 caches are valid but not emulated."""
    op = "flashmla.flash_mla_with_kvcache"
    sched_meta = tile_scheduler_metadata
    _flashmla_interface_checks(
        op,
        q,
        k_cache,
        sched_meta,
        num_splits,
        indices,
        (causal, is_fp8_kvcache, extra_k_cache, enable_batch_invariant),
    )
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    dense_extra = (attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length)
    if any(x is not None for x in (*dense_extra, extra_topk_length)):
        raise AssertionError(
            "indices_in_kvcache, attn_sink, extra_k_cache, extra_indices_in_kvcache, "
            "topk_length and extra_topk_length must be None when dense attention is used."
        )
    if block_table is None or cache_seqlens is None:
        raise AssertionError(
            "block_table and cache_seqlens must be provided when dense attention is used."
        )
    _not_emulated(op, out=out)
    rows, kv_lens, parts = _flashmla_kernel_checks(
        op, q, k_cache, head_dim_v, cache_seqlens, block_table, sched_meta
    )
    schedule: tuple[torch.Tensor | None, torch.Tensor | None] = (
        _flashmla_schedule(parts, kv_lens, q.device)  # the kernel plans it on its first call
        if sched_meta.tile_scheduler_metadata is None
        else (sched_meta.tile_scheduler_metadata, sched_meta.num_splits)
    )
    causal = bool(causal) and q.shape[1] > 1  # "if (seqlen_q_ori == 1) { is_causal = false; }"
    result, lse = _flashmla_math(
        q, k_cache, rows, kv_lens, head_dim_v, float(softmax_scale), causal
    )
    sched_meta.tile_scheduler_metadata, sched_meta.num_splits = schedule
    return result.to(q.dtype), lse


def _flashmla_interface_checks(
    op: str,
    q: object,
    k_cache: object,
    sched_meta: object,
    num_splits: object,
    indices: object,
    flags: tuple[bool, bool, torch.Tensor | None, bool],  # causal, fp8, extra_k_cache, invariant
) -> None:
    """The interface's asserts before the dense path, in its order, and its first invocation's
    record of the config (a later one is checked against it) [source]."""
    if not isinstance(sched_meta, FlashMLASchedMeta):
        raise AssertionError("tile_scheduler_metadata must be of type FlashMLASchedMeta")
    if num_splits is not None:
        raise AssertionError("num_splits must be None")
    if indices is not None:
        raise NotEmulatedError(f"{op}: sparse attention (indices) is valid but not emulated")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        got = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise _fail(op, f"q must be (batch_size, seq_len_q, num_heads_q, head_dim), got {got}")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        got = list(k_cache.shape) if isinstance(k_cache, torch.Tensor) else type(k_cache).__name__
        raise _fail(
            op, f"k_cache must be (num_blocks, page_block_size, num_heads_k, head_dim), got {got}"
        )
    causal, is_fp8_kvcache, extra_k_cache, enable_batch_invariant = flags
    cfg = FlashMLASchedMeta.Config(
        q.shape[0],
        q.shape[1],
        q.shape[2],
        k_cache.shape[1],
        k_cache.shape[2],
        causal,
        is_fp8_kvcache,
        None,
        None if extra_k_cache is None else extra_k_cache.shape[1],
        None,
        enable_batch_invariant,
    )
    if not sched_meta.have_initialized:  # the interface's first invocation: its config
        sched_meta.have_initialized = True
        sched_meta.config = cfg
    else:
        _flashmla_check_config(sched_meta, cfg)


def _flashmla_kernel_checks(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    head_dim_v: int,
    cache_seqlens: object,
    block_table: object,
    sched_meta: FlashMLASchedMeta,
) -> tuple[list[list[int]], list[int], int]:
    """``torch.ops._flashmla_C.dense_decode_fwd``'s checks [source: csrc/api/dense_decode],
    then the reads of the table and lengths (device code) with what the GPU would read
    undefined refused [inferred]: (table rows, key lengths, num_sm_parts)."""
    if q.dtype not in MODEL_DTYPES:
        raise _fail(
            op, f"Expected q_dtype == torch::kBFloat16 || q_dtype == torch::kHalf (got {q.dtype})"
        )
    if k_cache.dtype != q.dtype:
        raise _fail(op, f"query and key must have the same dtype ({q.dtype}, {k_cache.dtype})")
    dev = q.device
    for name, t in (("seqlens_k", cache_seqlens), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise _fail(
                op,
                f"{name} must have dtype {'int32' if name == 'seqlens_k' else 'torch.int32'}, "
                f"got {t.dtype}",
            )
    _tensor(op, "kcache", k_cache, 4, dev)
    seqlens = _tensor(op, "seqlens_k", cache_seqlens, 1, dev, contiguous=True)
    table = _tensor(op, "block_table", block_table, 2, dev)
    if q.stride(-1) != 1:
        raise _fail(op, "q must have contiguous last dimension")
    batch, s_q, h_q, head_size_k = q.shape
    if head_size_k not in (FLASHMLA_HEAD_DIM, 512):
        raise _fail(op, "Only head_size_k == 576 or 512 is supported")
    if head_dim_v != FLASHMLA_HEAD_DIM_V:
        raise _fail(op, "Only head_size_v == 576 is supported")  # the vendor's text
    num_blocks, page, h_k = k_cache.shape[:3]
    if page != FLASHMLA_PAGE_BLOCK_SIZE:
        raise _fail(op, f"Currently page_block_size must be 64 (got {page})")
    if batch <= 0:
        raise _fail(op, "batch size must be positive")
    if h_k <= 0 or h_q % h_k:
        raise _fail(op, "Number of heads in key/value must divide number of heads in query")
    if k_cache.shape[3] != head_size_k:
        raise _fail(
            op,
            f"kcache must have shape {[num_blocks, page, h_k, head_size_k]}, got "
            f"{list(k_cache.shape)}",
        )
    if tuple(seqlens.shape) != (batch,):
        raise _fail(op, f"seqlens_k must have shape [{batch}], got {list(seqlens.shape)}")
    if table.shape[0] != batch:
        raise _fail(
            op,
            f"block_table must have shape [{batch}, max_num_blocks_per_seq], got "
            f"{list(table.shape)}",
        )
    parts = _flashmla_num_sm_parts(s_q, h_q, h_k)
    kv_lens = seqlens.tolist()
    if kv_lens and min(kv_lens) < 0:
        raise _fail(op, f"seqlens_k holds {min(kv_lens)}: a length is >= 0")  # [inferred]
    if sched_meta.tile_scheduler_metadata is not None:
        _flashmla_check_schedule(op, sched_meta, parts, batch, kv_lens, dev)
    if head_size_k != FLASHMLA_HEAD_DIM:  # run_flash_splitkv_mla_kernel
        raise _fail(
            op,
            f"FLASH_ASSERT(params.d == Config::HEAD_DIM_K): d = {head_size_k}, the SM90 dense "
            "kernel takes 576",
        )
    rows = table.tolist()
    _check_table(op, k_cache, rows, kv_lens, list(range(batch + 1)))  # all have queries
    return rows, kv_lens, parts


def _flashmla_schedule(
    parts: int, kv_lens: list[int], dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule the kernel plans on a call without one (``get_decoding_sched_meta``):
    ``tile_scheduler_metadata (num_sm_parts, 8)`` and ``num_splits (batch + 1)``, int32. On the
    GPU they hold each SM part's request and block range and each request's first split; the
    emulator, which splits nothing, holds the key lengths it was planned for in
    ``num_splits[1:]`` [inferred: a stand-in], so that a reused schedule made for other lengths
    is refused (the kernel would run it: undefined)."""
    meta = torch.zeros(parts, _FLASHMLA_SCHED_META_INTS, dtype=torch.int32, device=dev)
    splits = torch.tensor([0, *kv_lens], dtype=torch.int32, device=dev)
    return meta, splits


def _flashmla_check_schedule(
    op: str,
    sched_meta: FlashMLASchedMeta,
    parts: int,
    batch: int,
    kv_lens: list[int],
    dev: torch.device,
) -> None:
    """dense_decode's checks of a given schedule (dtype, device, contiguity, shapes) [source],
    then that it was made for these lengths [inferred]."""
    for name, t, shape in (
        ("tile_scheduler_metadata", sched_meta.tile_scheduler_metadata, (parts, 8)),
        ("num_splits", sched_meta.num_splits, (batch + 1,)),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
            raise _fail(op, f"{name} must have dtype int32")
        if t.device != dev or not t.is_contiguous():
            raise _fail(op, f"{name} must be a contiguous tensor on {dev}")
        if tuple(t.shape) != shape:
            raise _fail(op, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    assert sched_meta.num_splits is not None
    if sched_meta.num_splits[1:].tolist() != kv_lens:
        raise _fail(
            op,
            "sched_meta was made for other cache_seqlens (reuse it only while the values of "
            "cache_seqlens remain the same)",
        )


def _flashmla_null(out_dtype: torch.dtype) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The null kernel of a FlashMLA decode whose output is ``out_dtype`` (the LSE float32)."""

    def null(
        q: torch.Tensor, k_cache: torch.Tensor, rows: Any, kv_lens: Any, head_dim_v: int, *_: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, s_q, h_q = q.shape[:3]
        return (
            emulation.preallocated((batch, s_q, h_q, head_dim_v), out_dtype, q.device),
            emulation.preallocated((batch, h_q, s_q), torch.float32, q.device),
        )

    return null


@emulation.kernel(null=_flashmla_null(torch.float32))
def _flashmla_math(
    q: torch.Tensor,  # [B, s_q, h_q, 576]
    k_cache: torch.Tensor,  # [num_blocks, 64, h_k, 576]
    rows: list[list[int]],  # the block table (host data: device code), checked
    kv_lens: list[int],
    head_dim_v: int,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, s_q, h_q, Dv] f32, lse [B, h_q, s_q] f32
    """``flash_mla_with_kvcache``'s math, every argument checked by it: per request, the
    softmax of ``scale * q . k`` over its keys (bottom-right causal where asked) times the
    values ``k[..., :head_dim_v]``; a row without keys: 0, LSE +inf."""
    batch, s_q, h_q, _ = q.shape
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=torch.float32)
    lse = torch.full((batch, h_q, s_q), math.inf, dtype=torch.float32)
    for b, kv_len in enumerate(kv_lens):
        keys = _paged_rows(k_cache, rows[b], kv_len)  # [kv_len, h_k, 576]
        o, l_ = _attend(
            q[b],
            keys,
            keys[..., :head_dim_v],
            scale=scale,
            window=(-1, 0) if causal else (-1, -1),
            softcap=0.0,
            slopes=None,
            sink=None,
            empty_lse=math.inf,
        )
        out[b], lse[b] = o, l_
    return out, lse


# --- FlashMLA's fp8 dense decode: vLLM's ops/flashmla.py wrappers of _flashmla_extension_C -------
# vLLM 0.32 / 0.33 define ``get_mla_metadata_dense_fp8`` and ``flash_mla_with_kvcache_fp8`` in
# ``vllm/v1/attention/ops/flashmla.py`` itself, over ``torch.ops._flashmla_extension_C``
# (``get_mla_decoding_metadata_dense_fp8``, ``fwd_kvcache_mla_fp8``): vllm-project/FlashMLA's
# csrc/extension/sm90/dense_fp8 (FlashMLA PR #54), a kernel of its own, not the dense decode's
# [source: the ops module; the extension's pybind.cpp, whose check texts the vLLM 0.33 wheel's
# ``_flashmla_extension_C.abi3.so`` holds].

#: ``get_mla_decoding_metadata_dense_fp8``'s row tile (``block_size_m``) [source].
_FLASHMLA_FP8_BLOCK_M = 64


def get_mla_metadata_dense_fp8(
    cache_seqlens: torch.Tensor,
    num_q_tokens_per_head_k: int,
    num_heads_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 kernel's tile schedule, planned on the host's stream: ``tile_scheduler_metadata
    (num_sm_parts, 8)`` and ``num_splits (batch + 1)``, int32, with ``num_sm_parts = sm_count /
    num_heads_k / ceil_div(num_q_tokens_per_head_k, 64)`` [source: pybind.cpp]. Checks:
    ``seqlens_k`` contiguous int32 on the device [source]. As for the dense decode's schedule,
    the emulator (which splits nothing) holds the lengths it was planned for in
    ``num_splits[1:]`` [inferred: a stand-in], so that a call with other lengths is refused."""
    op = "flashmla.get_mla_metadata_dense_fp8"
    if not isinstance(cache_seqlens, torch.Tensor):
        raise _fail(op, f"seqlens_k must be a Tensor, got {type(cache_seqlens).__name__}")
    if not cache_seqlens.is_contiguous():
        raise _fail(op, "Expected seqlens_k.is_contiguous() to be true, but got false.")
    if cache_seqlens.dtype != torch.int32:
        raise _fail(op, "Expected seqlens_k.dtype() == torch::kInt32 to be true, but got false.")
    if cache_seqlens.dim() != 1:
        raise _fail(op, f"seqlens_k must be (batch_size), got {list(cache_seqlens.shape)}")
    per_k = int(num_q_tokens_per_head_k)
    if per_k <= 0 or num_heads_k <= 0:
        raise _fail(op, "num_heads_per_head_k and num_heads_k must be positive")  # [inferred]
    parts = _FLASHMLA_NUM_SMS // num_heads_k // -(-per_k // _FLASHMLA_FP8_BLOCK_M)
    return _flashmla_schedule(parts, cache_seqlens.tolist(), cache_seqlens.device)


def flash_mla_with_kvcache_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's fp8 dense decode, as vLLM's FLASHMLA backend calls it over an fp8 latent
    cache (``forward_mqa``: q the absorbed query quantized to e4m3 with the layer's static
    ``_q_scale``, k_cache the joint fp8 plane ``(num_blocks, 64, 1, 576)``, ``head_dim_v`` 512,
    ``descale_q = _q_scale``, ``descale_k = _k_scale``, both shape (1,), causal) [callers].

    The math [source: dense_fp8/flash_fwd_mla_kernel.h, softmax.h]: scores ``q8 . k8`` over the
    576 columns, times ``softmax_scale * descale_q * descale_k``; per row ``e = exp(score -
    max)`` against the (running) row maximum, not scaled, rounded to e4m3 before ``P @ V`` with
    the values ``k8[..., :512]`` as stored (fp8); the output ``(P8 @ V8) * descale_k / sum(e)``
    with the sum of the unrounded ``e``, written as bfloat16 whatever the model dtype (``out_type
    = torch::kBFloat16``); LSE ``max + log(sum(e))`` float32, natural log, +inf for a row
    without keys (output 0). Causal bottom-right where ``s_q > 1`` (with ``s_q == 1`` the op
    drops it). The emulator rounds ``e`` against the row's maximum over all its keys, where the
    kernel rounds against the running maximum of its key tiles [inferred: one tiling; the
    scheme's bound covers any]; the scores are summed exactly, where the tensor cores'
    fp8 accumulation may round [inferred].

    Checks, in pybind.cpp's order (FlashOpError, its texts) [source]: q float8_e4m3fn; k_cache
    of q's dtype; int32 seqlens_k, block_table, tile_scheduler_metadata, num_splits; one
    device; contiguous last dims (seqlens_k, the schedule and num_splits contiguous); head_size_k
    576; head_size_v 512; page_block_size 64; batch_size > 0; num_heads_k dividing num_heads_q;
    both descales given, float32, contiguous last dim, shape (1,); the shapes of k_cache,
    seqlens_k, block_table, ``tile_scheduler_metadata.size(1) == 8`` and num_splits (batch + 1).
    Where the GPU would run on undefined input it refuses too [inferred]: pages outside the
    cache or too few for a length, a negative length, a schedule made for other lengths."""
    op = "flashmla.flash_mla_with_kvcache_fp8"
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        got = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise _fail(op, f"q must be (batch_size, seq_len_q, num_heads_q, head_dim), got {got}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    rows, kv_lens, descales = _flashmla_fp8_checks(
        op,
        q,
        k_cache,
        head_dim_v,
        cache_seqlens,
        block_table,
        (tile_scheduler_metadata, num_splits),
        (descale_q, descale_k),
    )
    causal = bool(causal) and q.shape[1] > 1  # "if (seqlen_q_ori == 1) { is_causal = false; }"
    return _flashmla_fp8_math(
        q, k_cache, rows, kv_lens, head_dim_v, float(softmax_scale), causal, descales
    )


def _flashmla_fp8_checks(
    op: str,
    q: torch.Tensor,
    k_cache: object,
    head_dim_v: int,
    cache_seqlens: object,
    block_table: object,
    schedule: tuple[object, object],
    descales: tuple[object, object],
) -> tuple[list[list[int]], list[int], tuple[float, float]]:
    """``fwd_kvcache_mla_fp8``'s checks in its order [source: dense_fp8/pybind.cpp], then the
    reads of the table, the lengths and the schedule [inferred]: (table rows, key lengths,
    (descale_q, descale_k))."""
    if q.dtype != FP8:
        raise _fail(
            op, f"Expected q.dtype() == torch::kFloat8_e4m3fn to be true, but got false ({q.dtype})"
        )
    if not isinstance(k_cache, torch.Tensor):
        raise _fail(op, f"kcache must be a Tensor, got {type(k_cache).__name__}")
    if k_cache.dtype != q.dtype:
        raise _fail(op, f"query and key must have the same dtype ({q.dtype}, {k_cache.dtype})")
    tile_meta, num_splits = schedule
    for name, t, text in (
        ("seqlens_k", cache_seqlens, "int32"),
        ("block_table", block_table, "torch.int32"),
        ("tile_scheduler_metadata", tile_meta, "int32"),
        ("num_splits", num_splits, "int32"),
    ):
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise _fail(op, f"{name} must have dtype {text}, got {t.dtype}")
    assert isinstance(tile_meta, torch.Tensor) and isinstance(num_splits, torch.Tensor)
    dev = q.device
    cache = _tensor(op, "kcache", k_cache, 4, dev)
    seqlens = _tensor(op, "seqlens_k", cache_seqlens, 1, dev, contiguous=True)
    table = _tensor(op, "block_table", block_table, 2, dev)
    meta = _tensor(op, "tile_scheduler_metadata", tile_meta, 2, dev, contiguous=True)
    splits = _tensor(op, "num_splits", num_splits, 1, dev, contiguous=True)
    if q.stride(-1) != 1:
        raise _fail(op, "q must have contiguous last dimension")
    batch, _, h_q, head_size_k = q.shape
    if head_size_k != FLASHMLA_HEAD_DIM:
        raise _fail(op, "Only head_size_k == 576 is supported")
    if head_dim_v != FLASHMLA_HEAD_DIM_V:
        raise _fail(op, "Only head_size_v == 512 is supported")
    page, h_k = cache.shape[1:3]
    if page != FLASHMLA_PAGE_BLOCK_SIZE:
        raise _fail(op, f"Currently page_block_size must be 64 (got {page})")
    if batch <= 0:
        raise _fail(op, "batch size must be positive")
    if h_k <= 0 or h_q % h_k:
        raise _fail(op, "Number of heads in key/value must divide number of heads in query")
    scales = _flashmla_descales(op, descales, dev)
    rows, kv_lens = _flashmla_fp8_reads(op, cache, seqlens, table, meta, splits, batch)
    return rows, kv_lens, scales


def _flashmla_descales(
    op: str, descales: tuple[object, object], dev: torch.device
) -> tuple[float, float]:
    """``descale_q`` and ``descale_k``: required, float32 tensors of shape (1) [source:
    dense_fp8/pybind.cpp]."""
    scales = []
    for name, d in zip(("descale_q", "descale_k"), descales, strict=True):
        if d is None:
            raise _fail(op, "descale is required when input dtype is fp8")
        t = _tensor(op, name, d, 1, dev) if isinstance(d, torch.Tensor) else None
        if t is None:
            raise _fail(op, f"{name} must be a Tensor, got {type(d).__name__}")
        if t.dtype != torch.float32:
            raise _fail(op, f"Expected {name}_.dtype() == torch::kFloat to be true, but got false")
        if tuple(t.shape) != (1,):
            raise _fail(op, f"{name}_ must have shape (1), got {list(t.shape)}")
        scales.append(float(t))
    return scales[0], scales[1]


def _flashmla_fp8_reads(
    op: str,
    cache: torch.Tensor,
    seqlens: torch.Tensor,
    table: torch.Tensor,
    meta: torch.Tensor,
    splits: torch.Tensor,
    batch: int,
) -> tuple[list[list[int]], list[int]]:
    """The shape checks of the cache, lengths, table and schedule in ``fwd_kvcache_mla_fp8``'s
    order [source], then their reads [inferred]: (table rows, key lengths)."""
    head_size_k = FLASHMLA_HEAD_DIM
    if cache.shape[3] != head_size_k:
        raise _fail(
            op,
            "kcache must have shape (num_blocks, page_block_size, num_heads_k, head_size_k), "
            f"got {list(cache.shape)}",
        )
    if tuple(seqlens.shape) != (batch,):
        raise _fail(op, f"seqlens_k must have shape (batch_size), got {list(seqlens.shape)}")
    if table.shape[0] != batch:
        raise _fail(
            op,
            "block_table must have shape (batch_size, max_num_blocks_per_seq), got "
            f"{list(table.shape)}",
        )
    if meta.shape[1] != _FLASHMLA_SCHED_META_INTS:
        raise _fail(
            op,
            "Expected tile_scheduler_metadata.size(1) == TileSchedulerMetaDataSize to be true, "
            "but got false",
        )
    if tuple(splits.shape) != (batch + 1,):
        raise _fail(op, f"num_splits must have shape (batch_size+1), got {list(splits.shape)}")
    kv_lens = seqlens.tolist()
    if kv_lens and min(kv_lens) < 0:
        raise _fail(op, f"seqlens_k holds {min(kv_lens)}: a length is >= 0")  # [inferred]
    if splits[1:].tolist() != kv_lens:  # the emulator's stand-in [inferred]
        raise _fail(
            op,
            "tile_scheduler_metadata / num_splits were planned (get_mla_metadata_dense_fp8) for "
            "other cache_seqlens",
        )
    rows = table.tolist()
    _check_table(op, cache, rows, kv_lens, list(range(batch + 1)))  # all have queries
    return rows, kv_lens


@emulation.kernel(null=_flashmla_null(torch.bfloat16))
def _flashmla_fp8_math(
    q: torch.Tensor,  # [B, s_q, h_q, 576] float8_e4m3fn
    k_cache: torch.Tensor,  # [num_blocks, 64, h_k, 576] float8_e4m3fn
    rows: list[list[int]],  # the block table (host data: device code), checked
    kv_lens: list[int],
    head_dim_v: int,
    scale: float,
    causal: bool,
    descales: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, s_q, h_q, Dv] bf16, lse [B, h_q, s_q] f32
    """``flash_mla_with_kvcache_fp8``'s math (its docstring), every argument checked by it."""
    batch, s_q, h_q, _ = q.shape
    h_k = k_cache.shape[2]
    descale_q, descale_k = descales
    # the kernel's softmax scale: softmax_scale * descale_q * descale_k, in float32
    scale32 = torch.tensor(scale, dtype=torch.float32) * descale_q * descale_k
    out = torch.zeros(batch, s_q, h_q, head_dim_v, dtype=torch.float32)
    lse = torch.full((batch, h_q, s_q), math.inf, dtype=torch.float32)
    raw = k_cache.view(torch.uint8)  # gathered as bytes (fp8 has no CPU index kernels)
    for b, kv_len in enumerate(kv_lens):
        if kv_len == 0:
            continue
        keys = _paged_rows(raw, rows[b], kv_len).view(FP8).to(torch.float64)  # [S, h_k, 576]
        keys = keys.repeat_interleave(h_q // h_k, dim=1)  # query head h reads kv head h // group
        qb = q[b].to(torch.float64)  # [s_q, h_q, 576]
        scores = torch.einsum("ihd,jhd->hij", qb, keys).to(torch.float32) * scale32
        if causal:  # query i of s_q sees kv_len - (s_q - 1 - i) keys
            seen = torch.arange(kv_len)[None, :] <= torch.arange(s_q)[:, None] + (kv_len - s_q)
            scores = scores.masked_fill(~seen, -math.inf)
        top = scores.amax(dim=-1, keepdim=True)  # [h_q, s_q, 1]
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        e = torch.exp(scores - top)  # float32, at most 1; masked keys 0
        total = e.sum(dim=-1)  # [h_q, s_q], unrounded
        p8 = e.to(FP8).to(torch.float64)  # rounded to e4m3, not scaled
        values = keys[..., :head_dim_v]  # [S, h_q, Dv]: the stored fp8 values
        acc = torch.einsum("hij,jhd->ihd", p8, values).to(torch.float32)  # [s_q, h_q, Dv]
        norm = torch.where(total > 0, descale_k / total, torch.ones_like(total))
        out[b] = acc * norm.t()[..., None]
        lse[b] = torch.where(total > 0, top[..., 0] + torch.log(total), math.inf)
    return out.to(torch.bfloat16), lse


# --- the namespaces ops.py hands out -----------------------------------------------------------


def _namespace(module: str, **fns: Callable[..., Any]) -> SimpleNamespace:
    ns = SimpleNamespace(__name__=f"emulated {module}")
    for name, fn in fns.items():
        wrapped = _counted(module, fn)
        wrapped.__name__ = name
        setattr(ns, name, wrapped)
    return ns


def _renamed(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    fn.__name__ = name
    return fn


VLLM = _namespace(
    "vllm.vllm_flash_attn",
    flash_attn_varlen_func=flash_attn_varlen_func,
    get_scheduler_metadata=get_scheduler_metadata,
)
VLLM_CACHE_OPS = _namespace(
    "vllm._custom_ops",
    reshape_and_cache_flash=reshape_and_cache_flash,
    concat_and_cache_mla=concat_and_cache_mla,
)
FA2 = _namespace(
    "flash_attn",
    flash_attn_varlen_func=_renamed(fa2_flash_attn_varlen_func, "flash_attn_varlen_func"),
    flash_attn_with_kvcache=_renamed(fa2_flash_attn_with_kvcache, "flash_attn_with_kvcache"),
)
FA3 = _namespace(
    "flash_attn_interface",
    flash_attn_with_kvcache=_renamed(fa3_flash_attn_with_kvcache, "flash_attn_with_kvcache"),
)
FLASHMLA = _namespace(
    "vllm.v1.attention.ops.flashmla",
    get_mla_metadata=get_mla_metadata,
    flash_mla_with_kvcache=flash_mla_with_kvcache,
    get_mla_metadata_dense_fp8=get_mla_metadata_dense_fp8,
    flash_mla_with_kvcache_fp8=flash_mla_with_kvcache_fp8,
)
FLASHMLA.FlashMLASchedMeta = FlashMLASchedMeta
FA4 = _namespace(
    "flash_attn.cute",
    flash_attn_varlen_func=_renamed(fa4_flash_attn_varlen_func, "flash_attn_varlen_func"),
)
#: The namespaces by the module each stands in for (what ``ops.resolve`` hands out on ``cpu``).
MODULES: dict[str, SimpleNamespace] = {
    "vllm.vllm_flash_attn": VLLM,
    "vllm._custom_ops": VLLM_CACHE_OPS,
    "flash_attn": FA2,
    "flash_attn_interface": FA3,
    "flash_attn.cute": FA4,
    "vllm.v1.attention.ops.flashmla": FLASHMLA,
}

#: Every emulated function, by its vendor path: what the contract test checks.
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "vllm.vllm_flash_attn.flash_attn_varlen_func": flash_attn_varlen_func,
    "vllm.vllm_flash_attn.get_scheduler_metadata": get_scheduler_metadata,
    "vllm._custom_ops.reshape_and_cache_flash": reshape_and_cache_flash,
    "vllm._custom_ops.concat_and_cache_mla": concat_and_cache_mla,
    "flash_attn.flash_attn_varlen_func": fa2_flash_attn_varlen_func,
    "flash_attn.flash_attn_with_kvcache": fa2_flash_attn_with_kvcache,
    "flash_attn_interface.flash_attn_with_kvcache": fa3_flash_attn_with_kvcache,
    "flash_attn.cute.flash_attn_varlen_func": fa4_flash_attn_varlen_func,
    "vllm.v1.attention.ops.flashmla.get_mla_metadata": get_mla_metadata,
    "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache": flash_mla_with_kvcache,
    "vllm.v1.attention.ops.flashmla.get_mla_metadata_dense_fp8": get_mla_metadata_dense_fp8,
    "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache_fp8": flash_mla_with_kvcache_fp8,
}
