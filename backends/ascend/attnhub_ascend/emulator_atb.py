"""The emulator's ``torch_npu.atb`` namespace: ATB's MLA paged-decode op with an LSE.

``torch_npu.atb.npu_multi_head_latent_attention`` is ``torch.ops.atb``'s op of that name
(torch_npu/op_plugin/atb/_atb_ops.py lists it in ``ATB_API_LIST``), an op packet whose four
overloads are registered from schema strings compiled into ``torch_npu/lib/libop_plugin_atb.so``
(not the codegen YAML; ``tests/test_ascend_contract.py`` reads them from the wheel):

  default   (..., kv_headnum, *, mask, qseqlen, qk_descale, pv_descale, mask_type, calc_type,
            cache_mode) -> Tensor
  .out      the same, ``*, ..., Tensor(a!) output``
  .lse      (..., kv_headnum, bool return_lse, *, ..., workspace=None) -> (Tensor, Tensor)
  .lse_out  the same, ``*, ..., workspace=None, Tensor(a!) output, Tensor(b!) lse``

As torch binds a packet, a call goes to the overload its arguments fit: ``return_lse`` (10th
positional or keyword) selects the ``.lse`` pair, ``output=`` (and ``lse=``) the out one, the
out arguments passed by their schema names (vllm-ascend: ``return_lse=True,
calc_type="calc_type_ring", workspace=..., output=attn_output, lse=softmax_lse`` [callers]).

What the op takes [doc: torch_npu's ``_atb_api_docs.py`` in the wheel; CANN's ATB reference,
MultiLatentAttentionOperation "参数列表" / "MLA输入输出" / "规格约束"; ``[inferred]`` where they are
silent]:
  - q_nope [num_tokens, num_heads, 512], q_rope [num_tokens, num_heads, 64]: float16/bfloat16
    (int8 q_nope only with the int8 NZ cache: not emulated);
  - ctkv [num_blocks, block_size, kv_heads, 512], k_rope [..., 64] (cache_mode 'krope_ctkv', ND;
    the NZ modes are not emulated); block_size <= 128;
  - block_tables int32 [batch, max_blocks]; context_lens int32 [batch] on the host (a list of
    ints, or a 1-D host tensor as vllm-ascend passes it [callers]);
  - q_headnum in {8, 16, 32, 64, 128}; kv_headnum 1; qk_scale in (0, 1]; batch <= 8192;
  - calc_type 'calc_type_undefined' (decode) or 'calc_type_ring' (ringAttention: an extra lse
    output, only with mask_type undefined); without qseqlen (calc_type_spec, not emulated) every
    query token is one batch entry, so batch = num_tokens [doc sample: batch = num_tokens;
    inferred as a rule];
  - outputs: attention out [num_tokens, num_heads, 512] in q_rope's dtype, lse
    [num_tokens, num_heads, 1] float16/bfloat16 (CANN's table; torch_npu's docstring also
    lists float: not emulated) [doc]; vllm-ascend allocates it in q_nope's dtype [callers].

The math: per token b, its first ``context_lens[b]`` cache positions through its block table,
``softmax(qk_scale * (q_nope . ctkv + q_rope . k_rope)) @ ctkv`` (the values are the nope part:
MLA's absorbed form), and the lse ``log(sum(exp(scores)))``, natural log [inferred: ring
attention merges two results by it, as FIA's softmax_lse], rounded to the lse tensor's dtype.
A token with context length 0 (vllm-ascend's padded rows, which it overwrites itself) comes out
NaN [inferred: the docs promise nothing there].
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnhub.kit import emulation
from attnhub_ascend.emulator import (
    MODEL_DTYPES,
    NotEmulatedError,
    NpuOpError,
    _attend,
    _counted_as,
    _fail,
    _int_list,
)

__attnhub_device_code__ = True

OP = "npu_multi_head_latent_attention"
NOPE_DIM = 512
ROPE_DIM = 64
HEADS = (8, 16, 32, 64, 128)  # MultiLatentAttentionParam.headNum [doc]
MAX_BLOCK_SIZE = 128  # "block_size <= 128，建议为128" [doc]
MAX_BATCH = 8192  # "batch <= 8192" [doc]
CALC_TYPES = ("calc_type_undefined", "calc_type_spec", "calc_type_ring")  # the binding's map
MASK_TYPES = ("undefined", "mask_type_spec", "mask_type_free")
CACHE_MODES = ("krope_ctkv", "int8_nzcache", "nzcache")


def _mode(name: str, value: object, allowed: tuple[str, ...], default: str) -> str:
    """A string mode as the binding maps it (``get_op_mode``: unknown strings are refused)."""
    if value is None:
        return default
    if value not in allowed:
        raise _fail(OP, f"{name}={value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _check_modes(
    return_lse: bool,
    mask: object,
    qseqlen: object,
    qk_descale: object,
    pv_descale: object,
    mask_type: object,
    calc_type: object,
    cache_mode: object,
) -> None:
    """The op's mode arguments: the cache, mask and calc types, and what each mode needs."""
    cache = _mode("cache_mode", cache_mode, CACHE_MODES, "krope_ctkv")
    if cache != "krope_ctkv":
        raise NotEmulatedError(f"{OP}: cache_mode={cache!r} (NZ caches) is valid but not emulated")
    masking = _mode("mask_type", mask_type, MASK_TYPES, "undefined")
    calc = _mode("calc_type", calc_type, CALC_TYPES, "calc_type_undefined")
    spec_decode = calc == "calc_type_spec" or masking != "undefined"
    if spec_decode or mask is not None or qseqlen is not None:
        raise NotEmulatedError(
            f"{OP}: calc_type_spec / masks / qseqlen (speculative decoding) are valid but not "
            "emulated"
        )
    if qk_descale is not None or pv_descale is not None:
        raise NotEmulatedError(f"{OP}: qk_descale / pv_descale (int8 caches) are not emulated")
    if return_lse and calc != "calc_type_ring":
        raise NotEmulatedError(
            f"{OP}: return_lse=True with calc_type={calc!r}: the docs name the lse output for "
            "the ring calc types only; not emulated"
        )
    if calc == "calc_type_ring" and not return_lse:
        raise _fail(OP, "calc_type='calc_type_ring' needs the lse output (return_lse=True)")


def _check(
    return_lse: bool,
    q_nope: object,
    q_rope: object,
    ctkv: object,
    k_rope: object,
    block_tables: object,
    context_lens: object,
    q_headnum: int,
    qk_scale: float,
    kv_headnum: int,
    mask: object,
    qseqlen: object,
    qk_descale: object,
    pv_descale: object,
    mask_type: object,
    calc_type: object,
    cache_mode: object,
) -> list[int]:
    """Every argument, in the op's order; returns the context lengths."""
    tensors = {"q_nope": q_nope, "q_rope": q_rope, "ctkv": ctkv, "k_rope": k_rope}
    tensors["block_tables"] = block_tables
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise _fail(OP, f"{name} must be a Tensor, got {type(t).__name__}")
    assert isinstance(q_nope, torch.Tensor) and isinstance(q_rope, torch.Tensor)
    assert isinstance(ctkv, torch.Tensor) and isinstance(k_rope, torch.Tensor)
    assert isinstance(block_tables, torch.Tensor)
    _check_modes(
        return_lse, mask, qseqlen, qk_descale, pv_descale, mask_type, calc_type, cache_mode
    )
    dev = q_nope.device
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor)
        if t.device != dev:
            raise _fail(OP, f"{name} is on {t.device}, q_nope on {dev}")
    if q_nope.dtype not in MODEL_DTYPES:
        raise (NotEmulatedError if q_nope.dtype == torch.int8 else NpuOpError)(
            f"{OP}: q_nope dtype {q_nope.dtype} (float16, bfloat16; int8 not emulated)"
        )
    if q_nope.dim() != 3 or q_nope.shape[2] != NOPE_DIM:
        raise _fail(OP, f"q_nope must be [num_tokens, num_heads, 512], got {list(q_nope.shape)}")
    T, heads, _ = q_nope.shape
    if q_rope.dtype != q_nope.dtype or tuple(q_rope.shape) != (T, heads, ROPE_DIM):
        raise _fail(
            OP,
            f"q_rope must be {q_nope.dtype} [{T}, {heads}, {ROPE_DIM}], got {q_rope.dtype} "
            f"{list(q_rope.shape)}",
        )
    if q_headnum != heads or heads not in HEADS:
        raise _fail(
            OP, f"q_headnum={q_headnum} must be q_nope's {heads} heads, one of {list(HEADS)}"
        )
    if kv_headnum != 1:
        raise _fail(OP, f"kv_headnum={kv_headnum}: the op takes 1")
    if not 0 < qk_scale <= 1:
        raise _fail(OP, f"qk_scale={qk_scale} is outside (0, 1]")
    if ctkv.dim() != 4 or tuple(ctkv.shape[2:]) != (kv_headnum, NOPE_DIM):
        raise _fail(OP, f"ctkv must be [num_blocks, block_size, 1, 512], got {list(ctkv.shape)}")
    if k_rope.dim() != 4 or tuple(k_rope.shape) != (*ctkv.shape[:3], ROPE_DIM):
        raise _fail(
            OP, f"k_rope must be {[*ctkv.shape[:3], ROPE_DIM]} (ctkv's with D 64), got "
            f"{list(k_rope.shape)}",
        )  # fmt: skip
    if ctkv.dtype != q_nope.dtype or k_rope.dtype != q_nope.dtype:
        raise _fail(OP, f"ctkv / k_rope dtypes {ctkv.dtype} / {k_rope.dtype}, q {q_nope.dtype}")
    if ctkv.shape[1] > MAX_BLOCK_SIZE:
        raise _fail(OP, f"block_size {ctkv.shape[1]}: the op takes block_size <= 128")
    for name, t in tensors.items():
        assert isinstance(t, torch.Tensor)
        if not t.is_contiguous():
            raise _fail(OP, f"{name} must be contiguous")
    return _check_lengths(context_lens, block_tables, T)


def _check_lengths(context_lens: object, block_tables: torch.Tensor, T: int) -> list[int]:
    """The host context lengths (one batch entry per query token) and the block table."""
    lens = _int_list(OP, "context_lens", context_lens, required=True)
    assert lens is not None
    batch = len(lens)
    if batch != T:
        raise _fail(
            OP,
            f"context_lens has {batch} entries, q_nope {T} tokens: without qseqlen each query "
            "token is one batch entry",
        )
    if batch > MAX_BATCH:
        raise _fail(OP, f"a batch of {batch}: the op takes at most {MAX_BATCH}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise _fail(
            OP,
            f"block_tables must be int32 [batch, max_blocks], got {block_tables.dtype} "
            f"{list(block_tables.shape)}",
        )
    return lens


def _check_reads(lens: list[int], table: torch.Tensor, num_blocks: int, bs: int) -> torch.Tensor:
    """Each token's context fits its block-table row and names blocks of the cache; returns the
    table as int64 on the host."""
    tab = table.to("cpu", torch.int64)
    capacity = tab.shape[1] * bs
    kv = np.asarray(lens, dtype=np.int64)
    # an entry with keys needs its row; vllm-ascend pads context_lens with zeros up to the
    # capture size, entries that read no block [callers]: a table without rows for them is
    # not refused [inferred]
    rowless = np.flatnonzero(kv[tab.shape[0] :] > 0)
    if rowless.size:
        b = tab.shape[0] + int(rowless[0])
        raise _fail(OP, f"context_lens[{b}] = {lens[b]} but block_tables has {tab.shape[0]} rows")
    kv = kv[: tab.shape[0]]
    bad_len = (kv < 0) | (kv > capacity)
    used = np.arange(tab.shape[1])[None, :] < ((np.clip(kv, 0, capacity) + bs - 1) // bs)[:, None]
    rows = tab.numpy()[: len(lens)]
    bad_block = (used & ((rows < 0) | (rows >= num_blocks))).any(axis=1)
    if bool(bad_len.any() or bad_block.any()):
        b = int(np.argmax(bad_len | bad_block))
        if bad_len[b]:
            raise _fail(
                OP, f"context_lens[{b}] = {lens[b]} does not fit the block table ({capacity} keys)"
            )
        raise _fail(OP, f"block_tables[{b}] names a block outside the {num_blocks} blocks")
    return tab


def _check_out(name: str, t: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(OP, f"{name} must be a Tensor, got {type(t).__name__}")
    if name == "lse" and t.dtype == torch.float32:
        raise NotEmulatedError(
            f"{OP}: a float32 lse (torch_npu's docstring lists float; CANN's ATB reference "
            "float16/bfloat16 only): not emulated"
        )
    if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
        raise _fail(
            OP,
            f"{name} must be a contiguous {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}",
        )
    return t


def _null(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctkv: torch.Tensor,
    k_rope: torch.Tensor,
    table: torch.Tensor,
    lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _d = q_nope.shape
    return (
        emulation.preallocated(q_nope.shape, q_nope.dtype, q_nope.device),
        emulation.preallocated((T, H, 1), q_nope.dtype, q_nope.device),
    )


@emulation.kernel(null=_null)
def _math(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctkv: torch.Tensor,
    k_rope: torch.Tensor,
    table: torch.Tensor,  # [>= batch, max_blocks] int64, host
    lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, 512], lse [T, H, 1]: q's dtype
    bs = ctkv.shape[1]
    nope = ctkv.reshape(-1, 1, NOPE_DIM)
    rope = k_rope.reshape(-1, 1, ROPE_DIM)
    q = torch.cat([q_nope, q_rope], dim=-1)
    out = torch.empty_like(q_nope)
    lse = torch.empty(*q_nope.shape[:2], 1, dtype=q_nope.dtype, device=q_nope.device)
    for b, n in enumerate(lens):  # the emulator loops; the backend never does
        if n == 0:  # no key: undefined [inferred]
            out[b] = math.nan
            lse[b] = math.nan
            continue
        pos = torch.arange(n)
        slots = (table[b, pos // bs] * bs + pos % bs).to(q.device)
        v = nope.index_select(0, slots)
        k = torch.cat([v, rope.index_select(0, slots)], dim=-1)
        o, l_ = _attend(q[b : b + 1], k, v, scale, None, None)
        out[b] = o[0].to(out.dtype)
        lse[b, :, 0] = l_[0].to(lse.dtype)
    return out, lse


def _run(
    args: tuple[Any, ...], return_lse: bool, kw: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    q_nope, q_rope, ctkv, k_rope, block_tables = args[:5]
    lens = _check(return_lse, *args, **kw)
    table = _check_reads(lens, block_tables, ctkv.shape[0], ctkv.shape[1])
    out, lse = _math(q_nope, q_rope, ctkv, k_rope, table, lens, float(args[7]))
    return out, lse, lens


_OPTS = ("mask", "qseqlen", "qk_descale", "pv_descale", "mask_type", "calc_type", "cache_mode")


def _default(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctkv: torch.Tensor,
    k_rope: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Any,
    q_headnum: int,
    qk_scale: float,
    kv_headnum: int,
    *,
    mask: torch.Tensor | None = None,
    qseqlen: Any = None,
    qk_descale: torch.Tensor | None = None,
    pv_descale: torch.Tensor | None = None,
    mask_type: str | None = None,
    calc_type: str | None = None,
    cache_mode: str | None = None,
) -> torch.Tensor:
    """The attention output alone (a new tensor in q_rope's dtype)."""
    kw = dict(
        zip(
            _OPTS,
            (mask, qseqlen, qk_descale, pv_descale, mask_type, calc_type, cache_mode),
            strict=True,
        )
    )
    args = (q_nope, q_rope, ctkv, k_rope, block_tables, context_lens, q_headnum, qk_scale)
    return _run((*args, kv_headnum), False, kw)[0]


def _out(*args: Any, output: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The default overload, written into ``output``."""
    got = _default(*args, **kwargs)
    _check_out("output", output, tuple(got.shape), got.dtype).copy_(got)
    return output


def _lse(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    ctkv: torch.Tensor,
    k_rope: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Any,
    q_headnum: int,
    qk_scale: float,
    kv_headnum: int,
    return_lse: bool,
    *,
    mask: torch.Tensor | None = None,
    qseqlen: Any = None,
    qk_descale: torch.Tensor | None = None,
    pv_descale: torch.Tensor | None = None,
    mask_type: str | None = None,
    calc_type: str | None = None,
    cache_mode: str | None = None,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention out, lse): the lse [num_tokens, num_heads, 1] in q's dtype."""
    kw = dict(
        zip(
            _OPTS,
            (mask, qseqlen, qk_descale, pv_descale, mask_type, calc_type, cache_mode),
            strict=True,
        )
    )
    if workspace is not None and not isinstance(workspace, torch.Tensor):
        raise _fail(OP, f"workspace must be a Tensor or None, got {type(workspace).__name__}")
    args = (q_nope, q_rope, ctkv, k_rope, block_tables, context_lens, q_headnum, qk_scale)
    out, lse, _ = _run((*args, kv_headnum), bool(return_lse), kw)
    return out, lse


def _lse_out(
    *args: Any, output: torch.Tensor, lse: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``.lse`` overload written into ``output`` and ``lse``."""
    got_out, got_lse = _lse(*args, **kwargs)
    _check_out("output", output, tuple(got_out.shape), got_out.dtype)
    _check_out("lse", lse, tuple(got_lse.shape), got_lse.dtype)
    output.copy_(got_out)
    lse.copy_(got_lse)
    return output, lse


def _get_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """A workspace for the call (uint8, one 64-byte partial per token and head: a model, not
    CANN's size [inferred]); the arguments are checked as the op checks them."""
    bound = _WS_SIG.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    names = list(a)
    pos = tuple(a[n] for n in names[:9])
    kw = {n: a[n] for n in _OPTS}
    _check(bool(a["return_lse"]), *pos, **kw)
    q = pos[0]
    return torch.zeros(64 * q.shape[0] * q.shape[1], dtype=torch.uint8, device=q.device)


def _with_params(fn: Callable[..., Any], base: Callable[..., Any], *extra: str) -> None:
    """``fn``'s signature: ``base``'s plus keyword-only out arguments (no default)."""
    sig = inspect.signature(base)
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [*sig.parameters.values(), *(inspect.Parameter(n, kw) for n in extra)]
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]


_with_params(_out, _default, "output")
_with_params(_lse_out, _lse, "output", "lse")
_WS_SIG = inspect.signature(_lse).replace(
    parameters=[p for p in inspect.signature(_lse).parameters.values() if p.name != "workspace"]
)
_get_workspace.__signature__ = _WS_SIG  # type: ignore[attr-defined]


class AtbPacket:
    """A ``torch.ops.atb`` packet: each overload by its schema name; calling the packet runs the
    overload the arguments fit, as torch's dispatcher picks among a packet's schemas."""

    def __init__(self, name: str, overloads: dict[str, Callable[..., Any]]) -> None:
        self.__name__ = name
        self.overloads = {
            key: _counted_as(name if key == "default" else f"{name}.{key}", fn, f"atb.{name}")
            for key, fn in overloads.items()
        }
        self.signatures = {key: inspect.signature(fn) for key, fn in overloads.items()}
        for key, op in self.overloads.items():
            setattr(self, key, op)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for key, sig in self.signatures.items():
            try:
                sig.bind(*args, **kwargs)
            except TypeError:
                continue
            return self.overloads[key](*args, **kwargs)
        raise TypeError(
            f"torch_npu.atb.{self.__name__}(): the arguments fit none of its overloads "
            f"({', '.join(self.signatures)})"
        )

    def __repr__(self) -> str:
        return f"<emulated torch_npu.atb.{self.__name__}>"


npu_multi_head_latent_attention = AtbPacket(
    OP, {"default": _default, "out": _out, "lse": _lse, "lse_out": _lse_out}
)
_npu_multi_head_latent_attention_get_workspace = AtbPacket(
    "_npu_multi_head_latent_attention_get_workspace", {"lse": _get_workspace}
)

#: The emulated ``torch_npu.atb`` ops, by name.
ATB_OPS: dict[str, AtbPacket] = {
    p.__name__: p
    for p in (npu_multi_head_latent_attention, _npu_multi_head_latent_attention_get_workspace)
}

#: What ``torch_npu.atb`` holds here.
namespace = types.SimpleNamespace(**ATB_OPS)
