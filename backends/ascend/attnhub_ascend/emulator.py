"""A pure-PyTorch CPU emulator of exactly the ``torch_npu`` ops ``attnhub_ascend`` calls.

On a machine without an Ascend NPU, ``ops.py`` hands the backend this module instead of
``torch_npu``, so the backend's real translation code runs on CPU. Every op here has the vendor's
name, parameter names, positional/keyword-only split, defaults (checked against the real
wheel's schema by ``backends/ascend/tests/test_ascend_contract.py``), ``.out`` overload, layout,
mask polarity, length conventions and return tuple, from the vendor docs (the wheel's
``torch_npu/_op_plugin_docs.py``, Ascend/op-plugin's ``docs/zh/custom_APIs/torch_npu/`` pages)
and ``shared/vendor-ops.md``.

It is as strict as the hardware and no stricter: where the vendor op rejects a call (wrong
layout, int64 block table, a lengths list of the wrong kind or length, a mask of the wrong shape
or dtype, a limit the doc states) it raises :class:`NpuOpError`, and a call the docs allow or a
hardware-run caller (vllm-ascend) makes passes; where the
call is valid for the vendor but uses something not emulated here (other layouts, quantization,
full masks) it raises :class:`NotEmulatedError`. It computes in float32 from its own reading of
the docs and never calls ``attnhub.reference`` (the conformance suite compares the two).

Emulated ops (the names ``torch_npu`` exposes):
  npu_fused_infer_attention_score     (+ ``.out``)  "FIA": TND layout, paged or packed K/V;
                                                    its MLA form (query_rope / key_rope, D 512,
                                                    paged), see ``_fia_mla``; in TND without page
                                                    attention keys 192 with values 128/192
                                                    (``_check_value_head_size``) and the D 128
                                                    rope form (``_fia_rope128``)
  npu_fused_infer_attention_score_v2  (+ ``.out``)  FIA v2: the same plus ``learnable_sink``
  npu_fusion_attention                              training FA: TND (packed K/V) or BSND
  npu_scatter_pa_kv_cache                           A2/A3 KV-cache write, cache_mode "Norm"
  _npu_reshape_and_cache                            ATB KV-cache write, int32 slots (310P)
  atb.npu_multi_head_latent_attention               ATB's MLA op with an lse (emulator_atb.py)
  _npu_fused_infer_attention_score(_v2)_get_max_workspace   a FIA workspace for the largest
                                                    lengths (graph capture; sizes: a model)

Conventions, as the docs state them (``[inferred]`` marks our reading where they are silent):
  - TND: query [T, N, D]; ``actual_seq_lengths`` / ``actual_seq_qlen`` are **cumulative** query
    ends (one per request; their count is the batch size B).
  - Paged K/V (``block_table`` given): cache [num_blocks, block_size, KV_N*D] or
    [num_blocks, KV_N, block_size, D]; ``block_table`` int32 [B, max_blocks];
    ``actual_seq_lengths_kv`` are **per-sequence** KV lengths. Packed TND K/V: cumulative ends.
  - ``atten_mask``: 1/True = masked out; FIA takes bool/int8/uint8, npu_fusion_attention only
    bool/uint8 (and in varlen only the 2-D form). sparse_mode 2/3/4 take the compressed
    2048x2048 mask ``triu(ones, 1)``; with q_len/kv_len of request b, query i and key j:
      2 keep j <= i (top-left)   3 keep j <= i + kv - q (bottom-right)
      4 keep -pre_tokens <= (j - i) - (kv - q) <= next_tokens (band; pre_tokens=W keeps W+1 keys)
      0 without a mask: every key (pre/next ignored).
  - FIA: a request with one query token is computed by the incremental (IFA) branch, where
    sparse_mode, pre_tokens and next_tokens are ignored ("Q_S为1时该参数无效"): it sees all
    kv_len keys. vendor-ops.md reads this per decode row of a TND batch; we emulate that,
    the strictest reading, by default (``SINGLE_TOKEN_IGNORES_SPARSE``; False emulates the
    other reading).
  - A FIA query row that sees no key is corrected to output 0 (LSE +inf [inferred]) only with
    ``inner_precise`` 2/3 or where the op detects it (sparse_mode 3 with Q_S > KV_S) [doc];
    otherwise the doc promises nothing, and the emulator returns NaN.
  - Limits [doc]: FIA TND <= 4096 requests, v1 sparse_mode 0..4; npu_fusion_attention varlen
    <= 1024 sequences, T <= 1M, no row that sees no key; trailing 0 entries of its cumulative
    lists are batches left out. Length lists may be 1-D integer host tensors [callers].
  - FIA returns (attention_out, softmax_lse); the LSE (float32, (T, N, 1) for TND) only with
    ``softmax_lse_flag`` / ``return_softmax_lse``, else a [1] zero tensor (the wheel's docs;
    vendor-ops.md says "an empty tensor").
  - npu_fusion_attention: without ``atten_mask``, sparse_mode / pre_tockens / next_tockens have
    no effect (full attention); varlen rows that see no key are rejected. sparse_mode 0 with a
    full bool/uint8 mask (varlen: [maxSq, maxSkv]) reads its top-left corner per request,
    within the pre/next band (anchored bottom-right [inferred]). ``sink`` (float32
    [head_num]) joins each row's softmax as one more logit.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnhub.kit import emulation

#: These ops stand in for the NPU: a host read made inside them is a read on the device, which
#: attnhub's host-sync guard (the conformance suite's) allows.
__attnhub_device_code__ = True

__all__ = [
    "Call",
    "NotEmulatedError",
    "NpuOpError",
    "OpPacket",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_reshape_and_cache",
    "call_counts",
    "compressed_causal_mask",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_fusion_attention",
    "npu_scatter_pa_kv_cache",
    "record_calls",
    "reset_call_counts",
]

INT_MAX = 2147483647
MASK_SIZE = 2048  # the compressed mask of sparse_mode 2/3/4 is MASK_SIZE x MASK_SIZE
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)  # FIA's atten_mask [doc]
FA_MASK_DTYPES = (torch.bool, torch.uint8)  # npu_fusion_attention's atten_mask [doc]
MASK_SHAPES = ((MASK_SIZE, MASK_SIZE), (1, MASK_SIZE, MASK_SIZE), (1, 1, MASK_SIZE, MASK_SIZE))
FIA_TND_MAX_BATCH = 4096  # TND: "元素个数即batch值（≤ 4096）" [doc]
FA_VARLEN_MAX_BATCH = 1024  # npu_fusion_attention varlen: "长度最大支持1K" [doc]
FA_VARLEN_MAX_T = 1 << 20  # npu_fusion_attention varlen: "T（B*S）取值范围1~1M" [doc]

#: How FIA treats a request with one query token in a TND batch. The doc says sparse_mode (and
#: with it pre_tokens / next_tokens) "is invalid when Q_S is 1" ("Q_S为1时该参数无效"); read
#: per request of a TND batch, a one-token request is computed over all its keys, band or not.
#: True (the default) emulates that reading, the stricter one; False emulates the other
#: (the band applies to one-token requests too) until a hardware run settles which is right.
SINGLE_TOKEN_IGNORES_SPARSE = True
MODEL_DTYPES = (torch.float16, torch.bfloat16)
LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND", "TND_NTD", "NTD_TND")


class NpuOpError(RuntimeError):
    """The call is one ``torch_npu`` rejects (the real op raises a RuntimeError too)."""


class NotEmulatedError(NotImplementedError):
    """A valid ``torch_npu`` call that uses something this emulator does not implement."""


# --- call accounting (tests count the fused calls a step makes) ----------------------------------

_log = emulation.OpLog()
#: One emulated op call, as the caller made it.
Call = emulation.Call
#: op name (with ``.out`` for the out overload) -> number of calls since the last reset.
call_counts: Counter[str] = _log.counts
reset_call_counts = _log.reset_counts
#: Collect every emulated op call made inside the block (name, args, kwargs).
record_calls = _log.record


def _counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    return _log.op(name, fn, binding=f"torch_npu.{name}", route=_route)


def _counted_as(name: str, fn: Callable[..., Any], binding: str) -> Callable[..., Any]:
    """``fn`` counted as ``name``, its binding errors naming ``torch_npu.{binding}``."""
    return _log.op(name, fn, binding=f"torch_npu.{binding}", route=_route)


def _route(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if graph_dispatch is not None:  # npu_graph: captured, or replacing a captured task
        return graph_dispatch(name, fn, args, kwargs)
    return fn(*args, **kwargs)


#: Set by ``attnhub_ascend.npu_graph`` (the emulated ``torch.npu`` graph API) when imported:
#: routes every op call through the graph being captured or the task being updated, if any.
graph_dispatch: Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any] | None = (
    None
)


class OpPacket:
    """An op as ``torch_npu`` exposes it (a ``torch.ops.npu`` packet): calling it runs the
    default overload; ``.out`` is the out overload where the vendor has one."""

    def __init__(
        self, name: str, default: Callable[..., Any], out: Callable[..., Any] | None = None
    ) -> None:
        self.__name__ = name
        self.default = _counted(name, default)
        self.__signature__ = inspect.signature(default)
        self.__doc__ = default.__doc__
        if out is not None:
            self.out = _counted(name + ".out", out)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<emulated torch_npu.{self.__name__}>"


# --- shared checks -------------------------------------------------------------------------------


def _fail(op: str, message: str) -> NpuOpError:
    return NpuOpError(f"{op}: {message}")


def _check_bsnd_caches(
    op: str,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    what: str,
) -> None:
    """The KV writes' cache shapes: [num_blocks, block_size, KV_N, Dk / Dv] matching key/value."""
    if (
        key_cache.dim() != 4
        or value_cache.dim() != 4
        or key_cache.shape[:2] != value_cache.shape[:2]
        or tuple(key_cache.shape[2:]) != tuple(key.shape[1:])
        or tuple(value_cache.shape[2:]) != tuple(value.shape[1:])
    ):
        raise _fail(
            op,
            f"{what} must be [num_blocks, block_size, KV_N, Dk / Dv] matching key "
            f"{list(key.shape)} and value {list(value.shape)}, got {list(key_cache.shape)} and "
            f"{list(value_cache.shape)}",
        )


def _not_emulated(op: str, **params: object) -> None:
    """Raise for any parameter that is set (not None / not its default) and not emulated."""
    for name, value in params.items():
        if value is not None and value is not False:
            raise NotEmulatedError(
                f"{op}: {name} is valid for torch_npu but not emulated (attnhub_ascend does "
                "not use it)"
            )


def _int_list(op: str, name: str, values: object, required: bool) -> list[int] | None:
    """A ``SymInt[]?`` argument: None, a list/tuple of ints (Python or numpy), a 1-D integer
    numpy array, or a 1-D integer host tensor, as the binding takes it (vllm-ascend passes its
    CPU ``seq_lens`` tensor as ``actual_seq_kvlen`` and a numpy array in its DCP graph update;
    the binding reads each element as an int)."""
    if values is None:
        if required:
            raise _fail(op, f"{name} is required with input_layout='TND'")
        return None
    if isinstance(values, np.ndarray):
        # vllm-ascend's DCP update passes np.concatenate(...) of its per-rank lengths [callers]
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise _fail(
                op,
                f"{name} as a numpy array must be 1-D and of an integer dtype, got "
                f"{values.dtype} {list(values.shape)}",
            )
        values = values.tolist()
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise _fail(
                op,
                f"{name} as a tensor must be 1-D and of an integer dtype, got "
                f"{values.dtype} {list(values.shape)}",
            )
        if values.device.type != "cpu":
            raise NotEmulatedError(
                f"{op}: {name} as a tensor on {values.device} (the emulator reads host tensors "
                "only; callers pass host data)"
            )
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise _fail(
            op,
            f"{name} must be a list of ints (SymInt[]), got {type(values).__name__}; build it on "
            "the host once per step",
        )
    out = []
    for i, v in enumerate(values):
        # numpy integers are ints to the binding (they implement __index__) [callers: vllm-ascend
        # and sglang pass lists and arrays built with numpy]
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise _fail(op, f"{name}[{i}] = {v!r} is not an int")
        out.append(int(v))
    return out


def _cumulative(
    op: str,
    name: str,
    ends: list[int],
    total: int,
    trailing_zeros: bool = False,
    rows_past_end: bool = False,
) -> list[int]:
    """Per-request lengths from cumulative ends; the last end must be ``total`` (the T of the
    packed tensor). A per-request list passed where ends belong fails here. With
    ``trailing_zeros`` (npu_fusion_attention's TND), trailing 0 entries are batches that take no
    part in the computation ("尾部传入对应个数个0", e.g. ``[2, 5, 9, 0, 0]``): length 0. With
    ``rows_past_end`` (FIA's query) the last end may stop short of ``total``: the rows past it
    belong to no request (vllm-ascend's DCP graph update pads its query ends by repeating the
    last one over a query of the capture size [callers])."""
    skipped = 0
    if trailing_zeros:
        while skipped < len(ends) - 1 and ends[len(ends) - 1 - skipped] == 0:
            skipped += 1
    computed = ends[: len(ends) - skipped]
    lengths = []
    prev = 0
    for i, end in enumerate(computed):
        if end < prev:
            raise _fail(
                op,
                f"{name} holds cumulative ends (each >= the previous, from 0), got "
                f"{name}[{i}] = {end} after {prev}: was a per-request length list passed?",
            )
        lengths.append(end - prev)
        prev = end
    if prev != total and not (rows_past_end and prev < total):
        raise _fail(
            op,
            f"{name}[-1] = {prev} must equal the packed T = {total} (cumulative ends; a "
            "per-request length list was passed where ends belong?)",
        )
    return lengths + [0] * skipped


def _check_tensor(op: str, name: str, t: object, dims: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise _fail(op, f"{name} must be {dims}-D, got shape {list(t.shape)}")
    if t.device != device:
        raise _fail(op, f"{name} is on {t.device}, query on {device}")
    if not t.is_contiguous():
        raise _fail(op, f"{name} must be contiguous (non-contiguous tensors are not supported)")
    return t


_checked_masks: dict[tuple[int, int, int | None], bool] = {}


def compressed_causal_mask(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.int8
) -> torch.Tensor:
    """The mask sparse_mode 2/3/4 take: [2048, 2048], 1 above the diagonal (= masked)."""
    return torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=dtype, device=device), 1)


def _check_compressed_mask(
    op: str,
    mask: object,
    sparse_mode: int,
    device: torch.device,
    dtypes: tuple[torch.dtype, ...] = MASK_DTYPES,
    shapes: tuple[tuple[int, ...], ...] = MASK_SHAPES,
) -> None:
    if mask is None:
        raise _fail(op, f"sparse_mode={sparse_mode} needs the compressed 2048x2048 atten_mask")
    if not isinstance(mask, torch.Tensor):
        raise _fail(op, f"atten_mask must be a Tensor, got {type(mask).__name__}")
    if mask.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise _fail(op, f"atten_mask must be one of {names}, got {mask.dtype}")
    if tuple(mask.shape) not in shapes:
        raise _fail(
            op,
            f"sparse_mode={sparse_mode} takes the compressed atten_mask of shape "
            f"{' or '.join(str(s) for s in shapes)}, got {list(mask.shape)}",
        )
    if mask.device != device:
        raise _fail(op, f"atten_mask is on {mask.device}, query on {device}")
    # The kernel reads the compressed mask as a lower-triangular template and the caller must
    # guarantee it is one (1 = masked above the diagonal). A wrong mask makes the real kernel
    # compute garbage silently; the emulator refuses it. Checked once per tensor version.
    # Inference tensors (made under torch.inference_mode, as engines run steps) have no
    # version counter: they cannot be modified in place, so their identity is enough.
    version = None if mask.is_inference() else mask._version
    key = (id(mask), mask.data_ptr(), version)
    if key not in _checked_masks:
        flat = mask.reshape(MASK_SIZE, MASK_SIZE).to("cpu", torch.int8)
        if not torch.equal(flat, compressed_causal_mask()):
            raise _fail(
                op,
                "atten_mask must be the compressed causal mask triu(ones(2048, 2048), 1) with "
                "1 = masked (polarity inverted or not triangular?)",
            )
        _checked_masks.clear()  # keep one entry: callers reuse one mask per device
        _checked_masks[key] = True


def _visible(
    q_len: int, kv_len: int, sparse_mode: int, pre_tokens: int, next_tokens: int
) -> torch.Tensor | None:  # [q_len, kv_len] bool, True = the query row sees the key; None: all
    """The documented sparse geometry of one request (query i, key j; offset = kv - q)."""
    if sparse_mode == 0:
        return None  # defaultMask without a mask: full attention, pre/next ignored
    i = torch.arange(q_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    if sparse_mode == 2:  # leftUpCausal
        return j <= i
    d = (j - i) - (kv_len - q_len)  # distance from the bottom-right aligned diagonal
    if sparse_mode == 3:  # rightDownCausal
        return d <= 0
    if sparse_mode == 4:  # band, anchored bottom-right
        return (d >= -pre_tokens) & (d <= next_tokens)
    raise AssertionError(sparse_mode)


def _attend(
    q: torch.Tensor,  # [q_len, N, D] (any float dtype)
    k: torch.Tensor,  # [kv_len, KV_N, D]
    v: torch.Tensor,  # [kv_len, KV_N, D]
    scale: float,
    visible: torch.Tensor | None,  # [q_len, kv_len] bool; None: every key
    sink: torch.Tensor | None,  # [N] float32 logits joining the denominator
    correct_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [q_len, N, D] f32, lse [q_len, N] f32
    """softmax(scale * q k^T [masked]) v for one request, GQA head h -> kv head h // (N/KV_N).

    A row that sees no key (and has no sink) gives output 0 and LSE +inf with
    ``correct_empty`` (FIA's "行无效修正", invalid-row correction) [inferred values]; without
    it the vendor documents only a possible precision loss, so the emulator returns NaN there:
    a result no caller can rely on."""
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # [KV_N, group * q_len, D]: the query heads sharing a kv head, stacked as rows
    qf = q.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    qf = qf.reshape(num_kv_heads, group * q_len, head_dim)
    kf = k.float().permute(1, 0, 2)  # [KV_N, kv_len, D]
    vf = v.float().permute(1, 0, 2)
    s = torch.bmm(qf, kf.transpose(1, 2)).mul_(scale)  # [KV_N, group * q_len, kv_len]
    s = s.view(num_kv_heads, group, q_len, kv_len)
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    m = s.amax(dim=-1, keepdim=True) if kv_len else s.new_full((*s.shape[:3], 1), -math.inf)
    if sink is not None:
        sink4 = sink.float().view(num_kv_heads, group, 1, 1)
        m = torch.maximum(m, sink4)
    safe_m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - safe_m)  # exp(-inf) = 0 for masked keys
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink4 - safe_m)
    empty = denom == 0  # no visible key and no sink
    p = e / torch.where(empty, torch.ones_like(denom), denom)
    if not correct_empty:
        p = p.masked_fill(empty, math.nan)
    out = torch.matmul(p.view(num_kv_heads, group * q_len, kv_len), vf)
    if not correct_empty and kv_len == 0:
        out = out.masked_fill(empty.view(num_kv_heads, group * q_len, 1), math.nan)
    v_dim = vf.shape[-1]  # the value head size (may be below the query/key one)
    out = out.view(num_kv_heads, group, q_len, v_dim).permute(2, 0, 1, 3)
    lse_empty = math.inf if correct_empty else math.nan
    lse = torch.where(empty, torch.full_like(denom, lse_empty), safe_m + torch.log(denom))
    lse = lse.view(num_kv_heads, group, q_len).permute(2, 0, 1)
    return out.reshape(q_len, num_heads, v_dim), lse.reshape(q_len, num_heads)


# --- FIA: npu_fused_infer_attention_score (v1, v2) -----------------------------------------------


@dataclass
class _FiaCall:
    """The arguments FIA v1 and v2 share, under v1's names."""

    op: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    atten_mask: torch.Tensor | None
    actual_seq_lengths: Sequence[int] | None
    actual_seq_lengths_kv: Sequence[int] | None
    block_table: torch.Tensor | None
    num_heads: int
    num_key_value_heads: int
    scale: float
    pre_tokens: int
    next_tokens: int
    input_layout: str
    sparse_mode: int
    block_size: int
    inner_precise: int
    #: sparse_mode values the op accepts: v1 0..4 ("仅支持0/1/2/3/4，其他值报错"); v2 adds 9.
    sparse_modes: tuple[int, ...]
    sink: torch.Tensor | None = None
    #: The MLA form: the rope parts of query and key (both or neither) [doc].
    query_rope: torch.Tensor | None = None
    key_rope: torch.Tensor | None = None
    lse_flag: bool = False


def _fia(c: _FiaCall) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, N, D] (query dtype), lse
    """FIA v1 and v2: every argument checked, in the op's order, then the math."""
    if c.query_rope is not None or c.key_rope is not None:
        return _fia_mla(c)
    kv_heads = _check_fia_tensors(c)
    q_lens, kv_list = _fia_lengths(c)
    keys, kv_lens = _fia_keys(c, q_lens, kv_list, kv_heads)
    _check_fia_sparse(c, q_lens)
    return _fia_math(c, q_lens, kv_lens, keys, _fia_sink(c))


def _check_fia_tensors(c: _FiaCall) -> int:
    """The layout (TND), the query's dtype and its heads and head size, and the key/value
    tensors against it; returns the number of K/V heads."""
    op = c.op
    if c.input_layout not in LAYOUTS:
        raise _fail(op, f"input_layout={c.input_layout!r} is not one of {', '.join(LAYOUTS)}")
    if c.input_layout != "TND":
        raise NotEmulatedError(
            f"{op}: input_layout={c.input_layout!r} is valid but only 'TND' is emulated"
        )
    q = c.query
    if not isinstance(q, torch.Tensor):
        raise _fail(op, f"query must be a Tensor, got {type(q).__name__}")
    dev = q.device
    _check_tensor(op, "query", q, 3, dev)
    if q.dtype not in MODEL_DTYPES:
        raise (NotEmulatedError if q.dtype == torch.int8 else NpuOpError)(
            f"{op}: query dtype {q.dtype} (supported: float16, bfloat16, int8; int8 not emulated)"
        )
    _, num_heads, head_dim = q.shape
    if num_heads != c.num_heads:
        raise _fail(op, f"num_heads={c.num_heads} but the TND query has {num_heads} heads")
    kv_heads = c.num_key_value_heads or num_heads
    if num_heads % kv_heads or num_heads // kv_heads > 64:
        raise _fail(
            op,
            f"num_heads={num_heads} must be a multiple of num_key_value_heads={kv_heads}, "
            "with a ratio of at most 64",
        )
    if num_heads > 256 or head_dim > 512 or head_dim % 16:
        raise _fail(
            op,
            f"N={num_heads} (<= 256) and D={head_dim} (<= 512, a multiple of 16 for "
            "float16/bfloat16) are out of range",
        )
    if head_dim == 512:
        # TND with query D = 512 needs query_rope and key_rope (MLA) [doc: TND constraints]:
        # D = 512 without them is refused (with them: _fia_mla).
        raise _fail(
            op,
            f"input_layout={c.input_layout!r} with D=512 needs query_rope and key_rope (the "
            "MLA form); without them TND takes other head sizes",
        )
    for name, t in (("key", c.key), ("value", c.value)):
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype:
            raise _fail(op, f"{name} dtype {t.dtype} differs from query dtype {q.dtype}")
        if t.shape != c.key.shape:
            _check_value_head_size(c, kv_heads)
        _check_tensor(op, name, t, t.dim(), dev)
    return kv_heads


#: FIA in TND with query D != 512 and no rope: Q_D = K_D = 192 with V_D 128 or 192 [doc].
TND_QK_DIM = 192
TND_V_DIMS = (128, 192)


def _check_value_head_size(c: _FiaCall, kv_heads: int) -> None:
    """Key and value of different shapes: only the TND form the doc names for query D != 512
    without rope ("要求Q_D、K_D等于192；TND场景，V_D等于128/192"), which holds "Q_N、K_N、V_N相等",
    "数据类型仅支持BFLOAT16", "sparse=0且不传mask，或sparse=3且传入mask" and no page attention;
    every other pair is refused as the general rule says ("key、value中对应tensor的shape需要完全
    一致"). vllm-ascend's MLA prefill makes this call (``query = cat(q_nope, q_pe)``,
    ``block_table=None``, ``num_key_value_heads=num_heads``, bfloat16) [callers: vllm-ascend
    0.23.0 attention/mla_v1.py]."""
    op, q, k, v = c.op, c.query, c.key, c.value
    form = (
        f"keys {list(k.shape)} and values {list(v.shape)} differ: FIA takes different K/V "
        f"shapes only in TND without page attention, query and key D {TND_QK_DIM}, value D "
        f"{' or '.join(map(str, TND_V_DIMS))}, bfloat16, as many K/V heads as query heads"
    )
    if (
        c.block_table is not None
        or k.dim() != 3
        or v.dim() != 3
        or k.shape[:2] != v.shape[:2]
        or q.shape[2] != TND_QK_DIM
        or k.shape[2] != TND_QK_DIM
        or v.shape[2] not in TND_V_DIMS
    ):
        raise _fail(op, form)
    if q.dtype != torch.bfloat16:
        raise _fail(op, f"{form}; got {q.dtype}")
    if kv_heads != q.shape[1] or k.shape[1] != q.shape[1]:
        raise _fail(op, f"{form}; got {q.shape[1]} query heads, {k.shape[1]} K/V heads")
    _check_tnd_sparse(c)


def _check_tnd_sparse(c: _FiaCall) -> None:
    """TND with query D != 512 without page attention: "sparse模式仅支持sparse=0且不传mask，或
    sparse=3且传入mask" [doc]."""
    if c.sparse_mode == 0 and c.atten_mask is None:
        return
    if c.sparse_mode == 3 and c.atten_mask is not None:
        return
    raise _fail(
        c.op,
        f"sparse_mode={c.sparse_mode}"
        + (" with a mask" if c.atten_mask is not None else " without a mask")
        + ": this TND form takes sparse_mode 0 without a mask or 3 with the compressed mask",
    )


def _value_dim(c: _FiaCall) -> int:
    """attention_out's D: the value's ("该入参的D维度与value的D保持一致") [doc]; with a paged
    cache of (nb, bs, KV_N*D) the query's."""
    if c.block_table is None and isinstance(c.value, torch.Tensor) and c.value.dim() == 3:
        return int(c.value.shape[2])
    return int(c.query.shape[2])


def _fia_lengths(c: _FiaCall) -> tuple[list[int], list[int]]:
    """The query lengths (from the cumulative ``actual_seq_lengths``) and the raw
    ``actual_seq_lengths_kv`` list, one entry per request."""
    op = c.op
    total = c.query.shape[0]
    q_ends = _int_list(op, "actual_seq_lengths", c.actual_seq_lengths, required=True)
    assert q_ends is not None
    q_lens = _cumulative(op, "actual_seq_lengths", q_ends, total, rows_past_end=True)
    batch = len(q_lens)
    if batch > FIA_TND_MAX_BATCH:
        raise _fail(
            op,
            f"a TND batch of {batch} requests (len(actual_seq_lengths)): at most "
            f"{FIA_TND_MAX_BATCH}",
        )
    kv_list = _int_list(op, "actual_seq_lengths_kv", c.actual_seq_lengths_kv, required=True)
    assert kv_list is not None
    if len(kv_list) != batch:
        raise _fail(
            op,
            f"actual_seq_lengths_kv has {len(kv_list)} entries, the batch has {batch} "
            "(len(actual_seq_lengths))",
        )
    return q_lens, kv_list


def _fia_keys(
    c: _FiaCall, q_lens: list[int], kv_list: list[int], kv_heads: int
) -> tuple[Callable[[int], tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Request ``b``'s keys and values, paged (``block_table``: per-request K/V lengths) or
    packed TND (cumulative K/V ends), and the K/V lengths."""
    op, dev, head_dim = c.op, c.query.device, c.query.shape[2]
    keys: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    if c.block_table is not None:  # paged K/V: per-sequence kv lengths
        keys, kv_lens = _paged_keys(c, q_lens, kv_list, kv_heads, head_dim)
    else:  # packed TND K/V: cumulative kv ends
        _check_tensor(op, "key", c.key, 3, dev)
        if tuple(c.key.shape[1:]) != (kv_heads, head_dim):
            raise _fail(
                op, f"TND key must be [T_kv, {kv_heads}, {head_dim}], got {list(c.key.shape)}"
            )
        kv_lens = _cumulative(op, "actual_seq_lengths_kv", kv_list, c.key.shape[0])
        starts = [e - n for e, n in zip(kv_list, kv_lens, strict=True)]

        def keys(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            rows = slice(starts[b], starts[b] + kv_lens[b])
            return c.key[rows], c.value[rows]

    return keys, kv_lens


def _check_fia_sparse(c: _FiaCall, q_lens: list[int]) -> None:
    """``sparse_mode`` with its mask and band, and ``inner_precise``."""
    op, dev = c.op, c.query.device
    if c.sparse_mode not in c.sparse_modes:
        raise _fail(
            op,
            f"sparse_mode={c.sparse_mode} is not one of {', '.join(map(str, c.sparse_modes))}",
        )
    if c.inner_precise not in (0, 1, 2, 3):
        raise _fail(op, f"inner_precise={c.inner_precise} is not one of 0, 1, 2, 3")
    if c.inner_precise in (2, 3) and all(n == 1 for n in q_lens):
        # "Q_S = 1时仅支持0和1" [doc]: read for a call whose every request has one query token
        # (the incremental branch); a mixed TND batch is not refused [inferred].
        raise _fail(op, f"inner_precise={c.inner_precise}: with Q_S = 1 only 0 and 1")
    if c.sparse_mode == 9:
        # v2's tree mask: "sparse_mode=9时，仅MLA场景（query_rope和key_rope不为空）支持" [doc]
        raise _fail(op, "sparse_mode=9 needs query_rope and key_rope (the MLA form)")
    if c.sparse_mode == 1 or (c.sparse_mode == 0 and c.atten_mask is not None):
        raise NotEmulatedError(
            f"{op}: sparse_mode={c.sparse_mode} with a full atten_mask is not emulated"
        )
    if c.sparse_mode in (2, 3, 4):
        _check_compressed_mask(op, c.atten_mask, c.sparse_mode, dev)
    if c.sparse_mode == 4 and c.pre_tokens + c.next_tokens < 0:
        raise _fail(op, f"band: pre_tokens + next_tokens = {c.pre_tokens + c.next_tokens} < 0")


def _fia_sink(c: _FiaCall) -> torch.Tensor | None:
    """v2's ``learnable_sink``: one bfloat16 logit per query head, value D <= 128."""
    op, dev = c.op, c.query.device
    num_heads, head_dim = c.query.shape[1], c.query.shape[2]
    sink = c.sink
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or sink.shape != (num_heads,):
        raise _fail(op, f"learnable_sink must be a Tensor of shape ({num_heads},)")
    if sink.dtype != torch.bfloat16:
        raise _fail(op, f"learnable_sink must be bfloat16, got {sink.dtype}")
    if sink.device != dev:
        raise _fail(op, f"learnable_sink is on {sink.device}, query on {dev}")
    if head_dim > 128:
        raise _fail(op, f"learnable_sink needs value D <= 128, got {head_dim}")
    return sink


def _fia_null(
    c: _FiaCall,
    q_lens: list[int],
    kv_lens: list[int],
    keys: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q = c.query
    lse_shape = (q.shape[0], q.shape[1], 1)
    return (
        emulation.preallocated((*q.shape[:2], _value_dim(c)), q.dtype, q.device),
        emulation.preallocated(lse_shape, torch.float32, q.device),
    )


@emulation.kernel(null=_fia_null)
def _fia_math(
    c: _FiaCall,
    q_lens: list[int],
    kv_lens: list[int],
    keys: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, N, D] (query dtype), lse [T, N, 1] float32
    """FIA's math, every argument checked by ``_fia``."""
    q = c.query
    out = q.new_empty((*q.shape[:2], _value_dim(c)))
    lse = torch.empty(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
    start = 0
    for b in range(len(q_lens)):  # the emulator loops; the backend never does
        q_len, kv_len = q_lens[b], kv_lens[b]
        if q_len == 0:
            continue
        k, v = keys(b)
        # One query token: the IFA branch, where sparse_mode / pre / next are ignored (under
        # the reading SINGLE_TOKEN_IGNORES_SPARSE selects).
        visible = (
            None
            if q_len == 1 and SINGLE_TOKEN_IGNORES_SPARSE
            else _visible(q_len, kv_len, c.sparse_mode, c.pre_tokens, c.next_tokens)
        )
        # Rows that see no key are corrected (output 0) only with inner_precise 2/3, or where
        # the op detects them itself ("如sparse_mode=3且Q_S > KV_S") [doc].
        correct = c.inner_precise in (2, 3) or (c.sparse_mode == 3 and q_len > kv_len)
        o, l_ = _attend(q[start : start + q_len], k, v, c.scale, visible, sink, correct)
        out[start : start + q_len] = o.to(q.dtype)
        lse[start : start + q_len, :, 0] = l_
        start += q_len
    # Rows past the last query end belong to no request: the doc promises nothing for them, so
    # they come out NaN (a caller must not read them) [inferred].
    out[start:] = math.nan
    lse[start:] = math.nan
    return out, lse


def _paged_keys(
    c: _FiaCall, q_lens: list[int], kv_lens: list[int], kv_heads: int, head_dim: int
) -> tuple[Callable[[int], tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Checks of the page-attention arguments; returns a reader of request b's K/V."""
    op, table, bs, key, value = c.op, c.block_table, c.block_size, c.key, c.value
    _check_block_table(c, len(q_lens))
    assert isinstance(table, torch.Tensor)
    if any(n > 1 for n in q_lens):  # the PFA branch
        if bs % 128 or not 128 <= bs <= 512:
            raise _fail(
                op,
                f"block_size={bs}: with query lengths > 1, page attention needs a multiple of "
                "128 in 128..512",
            )
    elif bs % 16 or bs > 512:  # the IFA branch (every request has one query token)
        raise _fail(op, f"block_size={bs}: must be a multiple of 16, at most 512")
    if key.dim() == 3:  # (num_blocks, block_size, KV_N * D)
        if key.shape[1] != bs or key.shape[2] != kv_heads * head_dim:
            raise _fail(
                op,
                f"a 3-D paged cache must be [num_blocks, block_size={bs}, "
                f"KV_N*D={kv_heads * head_dim}], got {list(key.shape)}",
            )
        if kv_heads * head_dim > 65535:
            raise _fail(op, f"KV_N*D = {kv_heads * head_dim} exceeds 65535 in the 3-D layout")
        flat_k = key.view(-1, kv_heads, head_dim)
        flat_v = value.view(-1, kv_heads, head_dim)
    elif key.dim() == 4:  # (num_blocks, KV_N, block_size, D)
        if tuple(key.shape[1:]) != (kv_heads, bs, head_dim):
            raise _fail(
                op,
                f"a 4-D paged cache must be [num_blocks, KV_N={kv_heads}, block_size={bs}, "
                f"D={head_dim}], got {list(key.shape)}",
            )
        flat_k = key.transpose(1, 2).reshape(-1, kv_heads, head_dim)
        flat_v = value.transpose(1, 2).reshape(-1, kv_heads, head_dim)
    else:
        raise _fail(op, f"a paged cache must be 3-D or 4-D, got {list(key.shape)}")
    table_l = _check_table_reads(c, kv_lens, key.shape[0])

    def keys(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(kv_lens[b])
        slots = (table_l[b, pos // bs] * bs + pos % bs).to(key.device)
        return flat_k.index_select(0, slots), flat_v.index_select(0, slots)

    return keys, kv_lens


def _check_block_table(c: _FiaCall, batch: int) -> None:
    """``block_table`` int32 [B, max_blocks] on the query's device, and a block size."""
    op, table, bs = c.op, c.block_table, c.block_size
    assert table is not None
    if not isinstance(table, torch.Tensor):
        raise _fail(op, f"block_table must be a Tensor, got {type(table).__name__}")
    if table.dtype != torch.int32:
        raise _fail(op, f"block_table must be int32, got {table.dtype}")
    if table.dim() != 2 or table.shape[0] != batch:
        raise _fail(
            op,
            f"block_table must be [B={batch}, max_blocks] (B = len(actual_seq_lengths)), "
            f"got {list(table.shape)}",
        )
    if table.device != c.query.device:
        raise _fail(op, f"block_table is on {table.device}, query on {c.query.device}")
    if bs <= 0:
        raise _fail(op, f"block_size={bs}: page attention needs the cache's block size")


def _check_table_reads(c: _FiaCall, kv_lens: list[int], num_blocks: int) -> torch.Tensor:
    """Per request, in order: its KV length fits the table, and the blocks it reads are blocks
    (one vectorized pass; the first failing request is named, as a loop over them would).
    Returns the table as int64 on the host."""
    op, table, bs = c.op, c.block_table, c.block_size
    assert isinstance(table, torch.Tensor)
    capacity = table.shape[1] * bs
    table_l = table.to("cpu", torch.int64)
    kv = np.asarray(kv_lens, dtype=np.int64)
    bad_len = (kv < 0) | (kv > capacity)
    used = np.arange(table.shape[1])[None, :] < ((np.clip(kv, 0, capacity) + bs - 1) // bs)[:, None]
    tab = table_l.numpy()
    bad_block = (used & ((tab < 0) | (tab >= num_blocks))).any(axis=1)
    if bool(bad_len.any() or bad_block.any()):
        b = int(np.argmax(bad_len | bad_block))
        if bad_len[b]:
            raise _fail(
                op,
                f"actual_seq_lengths_kv[{b}] = {kv_lens[b]} is not a per-sequence length within "
                f"the block table ({table.shape[1]} blocks x {bs}); with a paged cache it is "
                "the per-sequence KV length, not a cumulative end",
            )
        raise _fail(op, f"block_table[{b}] names a block outside the {num_blocks} blocks")
    return table_l


# --- FIA's MLA form (query_rope / key_rope) ------------------------------------------------------
#
# [doc: op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md, "query_rope和key_rope
# 输入时即为MLA场景" and the TND constraints; A2/A3]: query_rope / key_rope both or neither, their
# dtypes those of query / key; query D 512 or 128 with them (128: TND without page attention,
# the expanded prefill, not emulated). D 512: query S 1-16 per request, N 32/64/128, query_rope D
# 64 (other dims the query's); key N 1, D 512, key_rope D 64 (other dims the key's); page
# attention required, block_size 16 or 128 (ND); sparse_mode 0 without a mask when Q_S is 1,
# sparse_mode 3 with the compressed mask when Q_S > 1; no softmax LSE, left padding, pse,
# prefix or quantization. The scores are q . k_nope + q_rope . k_rope, scaled; the values are
# the nope part (callers pass k_nope as both key and value [callers: vllm-ascend's
# update_mla_attn_params]).

MLA_HEADS = (32, 64, 128)
MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_BLOCK_SIZES = (16, 128)
MLA_MAX_QUERY_LEN = 16


def _fia_mla(c: _FiaCall) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA's MLA form (D 512 with query_rope / key_rope): every argument checked, then the
    math."""
    op = c.op
    if c.query_rope is None or c.key_rope is None:
        raise _fail(op, "query_rope and key_rope must be given together (or neither)")
    if c.input_layout not in LAYOUTS:
        raise _fail(op, f"input_layout={c.input_layout!r} is not one of {', '.join(LAYOUTS)}")
    if c.input_layout != "TND":
        raise NotEmulatedError(
            f"{op}: input_layout={c.input_layout!r} is valid for the MLA form but only 'TND' "
            "is emulated"
        )
    q = c.query
    if not isinstance(q, torch.Tensor):
        raise _fail(op, f"query must be a Tensor, got {type(q).__name__}")
    dev = q.device
    _check_tensor(op, "query", q, 3, dev)
    if q.dtype not in MODEL_DTYPES:
        raise _fail(op, f"query dtype {q.dtype}: the MLA form takes float16, bfloat16")
    T, num_heads, head_dim = q.shape
    if head_dim == ROPE_FORM_DIM:
        return _fia_rope128(c)
    if head_dim != MLA_NOPE_DIM:
        raise _fail(op, f"with query_rope/key_rope the query D must be 512 or 128, got {head_dim}")
    if num_heads != c.num_heads:
        raise _fail(op, f"num_heads={c.num_heads} but the TND query has {num_heads} heads")
    if num_heads not in MLA_HEADS:
        raise _fail(op, f"the MLA form takes query N 32, 64 or 128, got {num_heads}")
    kv_heads = c.num_key_value_heads or num_heads
    if kv_heads != 1:
        raise _fail(op, f"the MLA form takes key N 1 (num_key_value_heads=1), got {kv_heads}")
    qr = _check_tensor(op, "query_rope", c.query_rope, 3, dev)
    if qr.dtype != q.dtype or tuple(qr.shape) != (T, num_heads, MLA_ROPE_DIM):
        raise _fail(
            op,
            f"query_rope must be {q.dtype} [{T}, {num_heads}, {MLA_ROPE_DIM}] (the query's dims "
            f"with D 64), got {qr.dtype} {list(qr.shape)}",
        )
    if c.lse_flag:
        raise _fail(op, "softmax_lse_flag=True: the MLA form (query D 512) returns no LSE")
    if c.block_table is None:
        raise _fail(op, "the MLA form (query D 512) needs page attention (block_table)")
    if c.block_size not in MLA_BLOCK_SIZES:
        raise _fail(op, f"block_size={c.block_size}: the MLA form takes 16 or 128")
    k_nope, k_rope = _mla_caches(c, q)
    q_lens, kv_list = _fia_lengths(c)
    _check_block_table(c, len(q_lens))
    longest = max(q_lens, default=0)
    if longest > MLA_MAX_QUERY_LEN:
        b = q_lens.index(longest)
        raise _fail(op, f"request {b} has {longest} query tokens: the MLA form takes 1-16")
    _check_mla_sparse(c, longest)
    table = _check_table_reads(c, kv_list, k_nope.shape[0])
    return _fia_mla_math(c, q_lens, kv_list, table, k_nope, k_rope)


#: FIA's rope form with query D 128: "inputLayout：TND、NTD_TND", query_rope / key_rope D 64 with
#: the other dims the query's / key's, Q_D = K_D = V_D = 128, Q_N = K_N = V_N, bfloat16, no page
#: attention, sparse 0 without a mask or 3 with it, <= 4096 requests [doc]; vllm-ascend's MLA
#: prefill (q_nope / k_nope 128 wide, q_pe / k_pe as the rope parts) [callers].
ROPE_FORM_DIM = 128


def _fia_rope128(c: _FiaCall) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA's rope form with query D 128 (MLA's expanded prefill): every argument checked, then
    ``softmax(scale * (q k^T + q_rope k_rope^T) [causal]) v`` per request over packed K/V."""
    op, q = c.op, c.query
    dev = q.device
    T, N, D = q.shape
    if q.dtype != torch.bfloat16:
        raise _fail(op, f"query D 128 with query_rope/key_rope takes bfloat16, got {q.dtype}")
    if c.block_table is not None:
        raise _fail(op, "query D 128 with query_rope/key_rope does not take page attention")
    if c.num_heads != N:
        raise _fail(op, f"num_heads={c.num_heads} but the TND query has {N} heads")
    kv_heads = c.num_key_value_heads or N
    tensors = {"key": c.key, "value": c.value, "query_rope": c.query_rope}
    tensors["key_rope"] = c.key_rope
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        _check_tensor(op, name, t, 3, dev)
        if t.dtype != q.dtype:
            raise _fail(op, f"{name} dtype {t.dtype} differs from query dtype {q.dtype}")
    k, v, qr, kr = c.key, c.value, c.query_rope, c.key_rope
    assert qr is not None and kr is not None
    if kv_heads != N or tuple(k.shape[1:]) != (N, D) or v.shape != k.shape:
        raise _fail(
            op,
            f"query D 128 with rope: key and value must be [T_kv, {N}, 128] (Q_N = K_N = V_N, "
            f"Q_D = K_D = V_D = 128), got {list(k.shape)} / {list(v.shape)}",
        )
    if tuple(qr.shape) != (T, N, MLA_ROPE_DIM) or tuple(kr.shape) != (*k.shape[:2], MLA_ROPE_DIM):
        raise _fail(
            op,
            f"query_rope / key_rope must be the query's / key's dims with D 64, got "
            f"{list(qr.shape)} / {list(kr.shape)}",
        )
    _check_tnd_sparse(c)
    if c.sparse_mode == 3:
        _check_compressed_mask(op, c.atten_mask, 3, dev)
    q_lens, kv_list = _fia_lengths(c)
    kv_lens = _cumulative(op, "actual_seq_lengths_kv", kv_list, k.shape[0])
    if c.sparse_mode == 3:
        for b, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
            # "当sparse=3时，要求每个batch单独的actualSeqLengths<actualSeqLengthsKv", read as <=:
            # vllm-ascend's prefill passes equal lists [callers]
            if ql > kl:
                raise _fail(op, f"request {b}: sparse_mode=3 needs query length {ql} <= {kl}")
    return _fia_rope128_math(c, q_lens, kv_lens)


def _fia_rope128_null(
    c: _FiaCall, q_lens: list[int], kv_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    q = c.query
    return (
        emulation.preallocated(q.shape, q.dtype, q.device),
        emulation.preallocated((q.shape[0], q.shape[1], 1), torch.float32, q.device),
    )


@emulation.kernel(null=_fia_rope128_null)
def _fia_rope128_math(
    c: _FiaCall, q_lens: list[int], kv_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, N, 128] (query dtype), lse [T, N, 1] float32
    q = torch.cat([c.query, c.query_rope], dim=-1)  # type: ignore[list-item]
    k = torch.cat([c.key, c.key_rope], dim=-1)  # type: ignore[list-item]
    out = torch.empty_like(c.query)
    lse = torch.empty(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
    qs = ks = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):  # the emulator loops
        if ql:
            visible = None if c.sparse_mode == 0 else _visible(ql, kl, 3, INT_MAX, INT_MAX)
            o, l_ = _attend(q[qs : qs + ql], k[ks : ks + kl], c.value[ks : ks + kl], c.scale,
                            visible, None, c.sparse_mode == 3 and ql > kl)  # fmt: skip
            out[qs : qs + ql] = o.to(out.dtype)
            lse[qs : qs + ql, :, 0] = l_
        qs, ks = qs + ql, ks + kl
    out[qs:] = math.nan
    lse[qs:] = math.nan
    return out, lse


def _mla_caches(c: _FiaCall, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged nope and rope planes as [num_slots, D] / [num_slots, 64]: key (= value) 3-D
    (num_blocks, block_size, 512) or 4-D (num_blocks, 1, block_size, 512), key_rope the same
    with D 64."""
    op, dev, bs = c.op, q.device, c.block_size
    key, value, key_rope = c.key, c.value, c.key_rope
    for name, t in (("key", key), ("value", value), ("key_rope", key_rope)):
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        _check_tensor(op, name, t, t.dim(), dev)
        if t.dtype != q.dtype:
            raise _fail(op, f"{name} dtype {t.dtype} differs from query dtype {q.dtype}")
    assert isinstance(key, torch.Tensor) and isinstance(key_rope, torch.Tensor)
    if value.shape != key.shape:
        raise _fail(op, f"key and value shapes differ: {list(key.shape)} vs {list(value.shape)}")
    if value.data_ptr() != key.data_ptr() or value.stride() != key.stride():
        # [inferred] the docs do not say whether the kernel reads the values from value or
        # from key; every caller passes the nope plane as both (key=value=k_nope).
        raise NotEmulatedError(
            f"{op}: the MLA form with a value other than key (the nope plane passed twice) is "
            "not emulated"
        )
    want = {3: (bs, MLA_NOPE_DIM), 4: (1, bs, MLA_NOPE_DIM)}.get(key.dim())
    if want is None or tuple(key.shape[1:]) != want:
        raise _fail(
            op,
            f"the MLA form's paged key must be [num_blocks, {bs}, 512] or [num_blocks, 1, {bs}, "
            f"512] (key N 1, D 512), got {list(key.shape)}",
        )
    rope_shape = (*key.shape[:-1], MLA_ROPE_DIM)
    if tuple(key_rope.shape) != rope_shape:
        raise _fail(
            op,
            f"key_rope must be {list(rope_shape)} (the key's dims with D 64), got "
            f"{list(key_rope.shape)}",
        )
    return key.reshape(-1, MLA_NOPE_DIM), key_rope.reshape(-1, MLA_ROPE_DIM)


def _check_mla_sparse(c: _FiaCall, longest: int) -> None:
    """Q_S 1: sparse_mode 0 without a mask; Q_S > 1: sparse_mode 3 with the compressed mask
    [doc]. In TND, Q_S is read as the longest request's query length [inferred]."""
    op = c.op
    if c.inner_precise not in (0, 1, 2, 3):
        raise _fail(op, f"inner_precise={c.inner_precise} is not one of 0, 1, 2, 3")
    if longest <= 1:
        if c.sparse_mode != 0 or c.atten_mask is not None:
            raise _fail(
                op,
                f"the MLA form with Q_S = 1 takes sparse_mode=0 without atten_mask, got "
                f"sparse_mode={c.sparse_mode}"
                + (" with a mask" if c.atten_mask is not None else ""),
            )
        if c.inner_precise in (2, 3):
            raise _fail(op, f"inner_precise={c.inner_precise}: with Q_S = 1 only 0 and 1")
        return
    if c.sparse_mode != 3:
        raise _fail(
            op,
            f"the MLA form with Q_S > 1 takes sparse_mode=3 with the compressed mask, got "
            f"sparse_mode={c.sparse_mode}",
        )
    _check_compressed_mask(op, c.atten_mask, 3, c.query.device)


def _fia_mla_null(
    c: _FiaCall,
    q_lens: list[int],
    kv_lens: list[int],
    table: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    q = c.query
    return (
        emulation.preallocated(q.shape, q.dtype, q.device),
        emulation.preallocated((q.shape[0], q.shape[1], 1), torch.float32, q.device),
    )


@emulation.kernel(null=_fia_mla_null)
def _fia_mla_math(
    c: _FiaCall,
    q_lens: list[int],
    kv_lens: list[int],
    table: torch.Tensor,  # [B, max_blocks] int64, host
    k_nope: torch.Tensor,  # [num_slots, 512]
    k_rope: torch.Tensor,  # [num_slots, 64]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, N, 512] (query dtype), lse [T, N, 1] float32
    """softmax(scale * (q k_nope^T + q_rope k_rope^T) [masked]) k_nope, per request: every head
    over the one latent KV head."""
    q, q_rope, bs = c.query, c.query_rope, c.block_size
    assert q_rope is not None
    # one K/V head of width 512 + 64: the two dot products summed
    q_cat = torch.cat([q, q_rope], dim=-1)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], 1, dtype=torch.float32, device=q.device)
    start = 0
    for b in range(len(q_lens)):  # the emulator loops; the backend never does
        q_len, kv_len = q_lens[b], kv_lens[b]
        if q_len == 0:
            continue
        pos = torch.arange(kv_len)
        slots = (table[b, pos // bs] * bs + pos % bs).to(q.device)
        nope = k_nope.index_select(0, slots)[:, None]  # [kv_len, 1, 512]
        k = torch.cat([nope, k_rope.index_select(0, slots)[:, None]], dim=-1)
        visible = None if c.sparse_mode == 0 else _visible(q_len, kv_len, 3, INT_MAX, INT_MAX)
        correct = c.inner_precise in (2, 3) or (c.sparse_mode == 3 and q_len > kv_len)
        o, l_ = _attend(q_cat[start : start + q_len], k, nope, c.scale, visible, None, correct)
        out[start : start + q_len] = o.to(q.dtype)
        lse[start : start + q_len, :, 0] = l_
        start += q_len
    out[start:] = math.nan  # rows past the last query end: no request's [inferred]
    lse[start:] = math.nan
    return out, lse


def _lse_result(
    op: str, lse: torch.Tensor, want: bool
) -> torch.Tensor:  # (T, N, 1) float32 or a [1] zero
    return lse if want else torch.zeros(1, dtype=torch.float32, device=lse.device)


def _write_out(
    op: str, out: object, result: torch.Tensor, lse: torch.Tensor, want_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The out overloads write ``out=[attention_out, softmax_lse]`` (torch binds the schema's two
    out arguments as one ``out`` list, the form torch_npu's docs and graph handlers use)."""
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        raise _fail(op, "out must be [attention_out, softmax_lse]")
    attention_out, softmax_lse = out
    if (
        not isinstance(attention_out, torch.Tensor)
        or attention_out.shape != result.shape
        or (attention_out.dtype != result.dtype)
    ):
        raise _fail(
            op,
            f"attention_out must be a {result.dtype} tensor of the query's shape with the "
            f"value's D, {list(result.shape)}",
        )
    if not attention_out.is_contiguous():
        raise _fail(op, "attention_out must be contiguous")
    if not isinstance(softmax_lse, torch.Tensor):
        raise _fail(op, f"softmax_lse must be a Tensor, got {type(softmax_lse).__name__}")
    if want_lse:
        # With the flag the op writes float32 (T, N, 1) [doc]. Without it softmax_lse is a
        # reserved output the op does not write: any dtype (vllm-ascend passes
        # torch.empty(1, dtype=query.dtype)) [callers; the OpApi passes it on unchecked].
        if softmax_lse.shape != lse.shape or softmax_lse.dtype != torch.float32:
            raise _fail(op, f"softmax_lse must be float32 {list(lse.shape)} with the LSE flag set")
    elif softmax_lse.numel() < 1:
        raise _fail(op, "softmax_lse (reserved without the LSE flag) needs at least 1 element")
    _copy_out(attention_out, result, softmax_lse if want_lse else None, lse)
    return attention_out, softmax_lse


@emulation.kernel(null=emulation.skip)
def _copy_out(
    attention_out: torch.Tensor,
    result: torch.Tensor,
    softmax_lse: torch.Tensor | None,
    lse: torch.Tensor,
) -> None:
    attention_out.copy_(result)
    if softmax_lse is not None:
        softmax_lse.copy_(lse)


def _fia_v1(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    dequant_scale1: torch.Tensor | None = None,
    quant_scale1: torch.Tensor | None = None,
    dequant_scale2: torch.Tensor | None = None,
    quant_scale2: torch.Tensor | None = None,
    quant_offset2: torch.Tensor | None = None,
    antiquant_scale: torch.Tensor | None = None,
    antiquant_offset: torch.Tensor | None = None,
    key_antiquant_scale: torch.Tensor | None = None,
    key_antiquant_offset: torch.Tensor | None = None,
    value_antiquant_scale: torch.Tensor | None = None,
    value_antiquant_offset: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    query_padding_size: torch.Tensor | None = None,
    kv_padding_size: torch.Tensor | None = None,
    key_shared_prefix: torch.Tensor | None = None,
    value_shared_prefix: torch.Tensor | None = None,
    actual_shared_prefix_len: Sequence[int] | None = None,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    key_rope_antiquant_scale: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    antiquant_mode: int = 0,
    key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA: returns (attention_out [query's shape and dtype], softmax_lse)."""
    op = "npu_fused_infer_attention_score"
    _not_emulated(
        op,
        pse_shift=pse_shift,
        dequant_scale1=dequant_scale1,
        quant_scale1=quant_scale1,
        dequant_scale2=dequant_scale2,
        quant_scale2=quant_scale2,
        quant_offset2=quant_offset2,
        antiquant_scale=antiquant_scale,
        antiquant_offset=antiquant_offset,
        key_antiquant_scale=key_antiquant_scale,
        key_antiquant_offset=key_antiquant_offset,
        value_antiquant_scale=value_antiquant_scale,
        value_antiquant_offset=value_antiquant_offset,
        query_padding_size=query_padding_size,
        kv_padding_size=kv_padding_size,
        key_shared_prefix=key_shared_prefix,
        value_shared_prefix=value_shared_prefix,
        actual_shared_prefix_len=actual_shared_prefix_len,
        key_rope_antiquant_scale=key_rope_antiquant_scale,
    )
    if antiquant_mode or key_antiquant_mode or value_antiquant_mode:
        raise NotEmulatedError(f"{op}: antiquant modes are not emulated")
    out, lse = _fia(
        _FiaCall(
            op,
            query,
            key,
            value,
            atten_mask,
            actual_seq_lengths,
            actual_seq_lengths_kv,
            block_table,
            num_heads,
            num_key_value_heads,
            scale,
            pre_tokens,
            next_tokens,
            input_layout,
            sparse_mode,
            block_size,
            inner_precise,
            (0, 1, 2, 3, 4),
            query_rope=query_rope,
            key_rope=key_rope,
            lse_flag=bool(softmax_lse_flag),
        )
    )
    return out, _lse_result(op, lse, softmax_lse_flag)


def _fia_v1_out(
    *args: Any, workspace: torch.Tensor | None = None, out: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "npu_fused_infer_attention_score.out"
    result, lse = _fia_v1(*args, **kwargs)
    _check_workspace(op, workspace, _V1_SIG, args, kwargs, _FIA_LISTS, "num_heads", result)
    want = bool(kwargs.get("softmax_lse_flag", False))
    return _write_out(op, out, result, lse, want)


def _fia_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    block_table: torch.Tensor | None = None,
    dequant_scale_query: torch.Tensor | None = None,
    dequant_scale_key: torch.Tensor | None = None,
    dequant_offset_key: torch.Tensor | None = None,
    dequant_scale_value: torch.Tensor | None = None,
    dequant_offset_value: torch.Tensor | None = None,
    dequant_scale_key_rope: torch.Tensor | None = None,
    quant_scale_out: torch.Tensor | None = None,
    quant_offset_out: torch.Tensor | None = None,
    quant_scale_p: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    softmax_scale: float = 1.0,
    pre_tokens: int = 2147483647,
    next_tokens: int = 2147483647,
    input_layout: str = "BSH",
    sparse_mode: int = 0,
    block_size: int = 0,
    query_quant_mode: int = 0,
    key_quant_mode: int = 0,
    value_quant_mode: int = 0,
    inner_precise: int = 0,
    return_softmax_lse: bool = False,
    query_dtype: int | None = None,
    key_dtype: int | None = None,
    value_dtype: int | None = None,
    query_rope_dtype: int | None = None,
    key_rope_dtype: int | None = None,
    key_shared_prefix_dtype: int | None = None,
    value_shared_prefix_dtype: int | None = None,
    dequant_scale_query_dtype: int | None = None,
    dequant_scale_key_dtype: int | None = None,
    dequant_scale_value_dtype: int | None = None,
    dequant_scale_key_rope_dtype: int | None = None,
    out_dtype: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA v2: v1's computation under new names, plus ``learnable_sink`` (the sink logit per
    query head, bfloat16 (Q_N,), TND only, value D <= 128)."""
    op = "npu_fused_infer_attention_score_v2"
    _not_emulated(
        op,
        query_rope=query_rope,
        key_rope=key_rope,
        pse_shift=pse_shift,
        dequant_scale_query=dequant_scale_query,
        dequant_scale_key=dequant_scale_key,
        dequant_offset_key=dequant_offset_key,
        dequant_scale_value=dequant_scale_value,
        dequant_offset_value=dequant_offset_value,
        dequant_scale_key_rope=dequant_scale_key_rope,
        quant_scale_out=quant_scale_out,
        quant_offset_out=quant_offset_out,
        quant_scale_p=quant_scale_p,
        out_dtype=out_dtype,
    )
    if query_quant_mode or key_quant_mode or value_quant_mode:
        raise NotEmulatedError(f"{op}: quant modes are not emulated")
    if learnable_sink is not None and input_layout not in ("TND", "NTD_TND"):
        raise _fail(op, f"learnable_sink needs input_layout TND or NTD_TND, got {input_layout!r}")
    out, lse = _fia(
        _FiaCall(
            op,
            query,
            key,
            value,
            atten_mask,
            actual_seq_qlen,
            actual_seq_kvlen,
            block_table,
            num_query_heads,
            num_key_value_heads,
            softmax_scale,
            pre_tokens,
            next_tokens,
            input_layout,
            sparse_mode,
            block_size,
            inner_precise,
            (0, 1, 2, 3, 4, 9),
            learnable_sink,
        )
    )
    return out, _lse_result(op, lse, return_softmax_lse)


def _fia_v2_out(
    *args: Any, workspace: torch.Tensor | None = None, out: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "npu_fused_infer_attention_score_v2.out"
    result, lse = _fia_v2(*args, **{**kwargs, "return_softmax_lse": True})
    _check_workspace(op, workspace, _V2_SIG, args, kwargs, _FIA_V2_LISTS, "num_query_heads", result)
    want = bool(kwargs.get("return_softmax_lse", False))
    return _write_out(op, out, result, lse, want)


# --- workspaces ----------------------------------------------------------------------------------
#
# ``.out`` with ``workspace=None`` sizes and allocates a workspace for this very call
# (op-plugin: EXEC_NPU_NO_FORMAT_CHECK_CMD); with a workspace it runs in that memory, its size
# ``numel * element_size`` (EXEC_UPDATE_NPU_NO_FORMAT_CHECK_CMD), never checking it against what
# the call needs: a smaller one is overrun on the device. The ``_get_max_workspace`` ops return a
# workspace (a 1-D tensor of the query's dtype) for the largest lengths the call's shapes allow
# [source: op-plugin FusedInferAttentionScoreKernelNpuOpApi.cpp / update_op_api_common.h].
# How many bytes a call needs is CANN's secret: the emulator uses its own model, one 64-byte
# partial result per query head, request and 128 keys plus one per request and head [inferred:
# a model, not the vendor's figures], which grows with the KV lengths as a split-KV kernel's
# does. A workspace sized for short lengths is then too small for longer ones, as on the device.

_WORKSPACE_UNIT = 64  # bytes per (request, head, 128-key split) [inferred model]
_FIA_LISTS = ("actual_seq_lengths", "actual_seq_lengths_kv")
_FIA_V2_LISTS = ("actual_seq_qlen", "actual_seq_kvlen")


def _workspace_bytes(num_heads: int, kv_lens: Sequence[int]) -> int:
    splits = sum(1 + (max(int(n), 0) + 127) // 128 for n in kv_lens)
    return _WORKSPACE_UNIT * num_heads * splits


def _fia_call_kv_lens(kw: dict[str, Any], lists: tuple[str, str], op: str) -> list[int]:
    """Per-request KV lengths of a checked FIA call (paged: as given; packed: from the ends)."""
    kv = _int_list(op, lists[1], kw.get(lists[1]), required=True) or []
    if kw.get("block_table") is not None:
        return kv
    return [end - start for start, end in zip([0, *kv[:-1]], kv, strict=True)]


def _check_workspace(
    op: str,
    workspace: object,
    sig: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lists: tuple[str, str],
    heads_name: str,
    result: torch.Tensor,
) -> None:
    if workspace is None:
        return  # sized and allocated for this call (see above)
    if not isinstance(workspace, torch.Tensor):
        raise _fail(op, f"workspace must be a Tensor or None, got {type(workspace).__name__}")
    if workspace.device != result.device:
        raise _fail(op, f"workspace is on {workspace.device}, query on {result.device}")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    kw = bound.arguments
    need = _workspace_bytes(int(kw[heads_name]), _fia_call_kv_lens(kw, lists, op))
    have = workspace.numel() * workspace.element_size()
    if have < need:
        raise _fail(
            op,
            f"workspace of {have} bytes, this call needs {need} (its KV lengths are longer than "
            "those the workspace was sized for: size it with _get_max_workspace for the largest "
            "lengths) [the emulator's workspace model]",
        )


def _max_workspace(
    op: str,
    sig: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lists: tuple[str, str],
    heads_name: str,
) -> torch.Tensor:
    """A workspace for the largest KV lengths these shapes allow: every request of the lists'
    batch at the block table's capacity (paged) or at the packed key count."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    kw = bound.arguments
    query, key = kw["query"], kw["key"]
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        raise _fail(op, "query and key must be Tensors")
    q_ends = _int_list(op, lists[0], kw.get(lists[0]), required=True) or []
    table = kw.get("block_table")
    if isinstance(table, torch.Tensor):
        if table.dim() != 2:
            raise _fail(op, f"block_table must be 2-D, got {list(table.shape)}")
        capacity = table.shape[1] * int(kw["block_size"])
    else:
        capacity = key.shape[0]
    need = _workspace_bytes(int(kw[heads_name]), [capacity] * len(q_ends))
    elems = -(-need // query.element_size())
    return torch.empty(elems, dtype=query.dtype, device=query.device)


def _fia_v1_max_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    return _max_workspace(
        "_npu_fused_infer_attention_score_get_max_workspace",
        _V1_SIG,
        args,
        kwargs,
        _FIA_LISTS,
        "num_heads",
    )


def _fia_v2_max_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    return _max_workspace(
        "_npu_fused_infer_attention_score_v2_get_max_workspace",
        _V2_SIG,
        args,
        kwargs,
        _FIA_V2_LISTS,
        "num_query_heads",
    )


def _out_signature(default: Callable[..., Any]) -> inspect.Signature:
    """The out overload's signature: the default's, then ``workspace=None`` and ``out``."""
    sig = inspect.signature(default)
    kw = inspect.Parameter.KEYWORD_ONLY
    extra = [
        inspect.Parameter("workspace", kw, default=None, annotation="torch.Tensor | None"),
        inspect.Parameter("out", kw, annotation="list[torch.Tensor]"),
    ]
    return sig.replace(parameters=[*sig.parameters.values(), *extra])


_V1_SIG = inspect.signature(_fia_v1)
_V2_SIG = inspect.signature(_fia_v2)
_fia_v1_out.__signature__ = _out_signature(_fia_v1)  # type: ignore[attr-defined]
_fia_v2_out.__signature__ = _out_signature(_fia_v2)  # type: ignore[attr-defined]
# the max-workspace queries take exactly the default overload's arguments [schema]
_fia_v1_max_workspace.__signature__ = _V1_SIG.replace(  # type: ignore[attr-defined]
    return_annotation="torch.Tensor"
)
_fia_v2_max_workspace.__signature__ = _V2_SIG.replace(  # type: ignore[attr-defined]
    return_annotation="torch.Tensor"
)


# --- npu_fusion_attention (training FA; TND with packed K/V) -------------------------------------


def _npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = 2147483647,
    next_tockens: int = 2147483647,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Returns (attention_out, softmax_max, softmax_sum, softmax_out (reserved), seed, offset,
    numels). Every argument is positional-or-keyword, and ``tockens`` is the vendor's spelling.
    With atten_mask None, sparse_mode / pre_tockens / next_tockens have no effect (full)."""
    op = "npu_fusion_attention"
    _not_emulated(op, pse=pse, padding_mask=padding_mask, prefix=prefix, dropout_mask=dropout_mask)
    if keep_prob != 1.0:
        raise NotEmulatedError(f"{op}: dropout (keep_prob={keep_prob}) is not emulated")
    varlen = _check_fusion_layout(op, input_layout, query)
    query, key, value, bsnd = _fusion_tokens(op, query, key, value, varlen)
    _check_fusion_heads(op, query, key, value, head_num, sink)
    if softmax_layout not in ("", "TND") or (softmax_layout and not varlen):
        raise _fail(op, f"softmax_layout={softmax_layout!r} ('' or, with TND, 'TND')")
    q_lens, kv_lens = _fusion_lengths(
        op, query.shape[0], key.shape[0], bsnd, actual_seq_qlen, actual_seq_kvlen
    )
    masks = _fusion_masks(
        op,
        atten_mask,
        sparse_mode,
        pre_tockens,
        next_tockens,
        q_lens,
        kv_lens,
        query.device,
        varlen=varlen,
    )
    # outside varlen a fully masked row is corrected only with inner_precise 2 ("使能无效行计
    # 算"); otherwise the doc promises nothing: NaN
    correct = varlen or inner_precise == 2
    out = _fusion_attention_math(
        query,
        key,
        value,
        scale,
        q_lens,
        kv_lens,
        masks,
        softmax_layout,
        seed,
        offset,
        sink,
        correct,
    )
    if bsnd is None:
        return out
    batch, q_s, _ = bsnd
    result, row_max, row_sum = out[0], out[1], out[2]
    stats = [
        t.view(head_num, batch, q_s, 8).permute(1, 0, 2, 3).contiguous() for t in (row_max, row_sum)
    ]
    return (result.view(batch, q_s, *result.shape[1:]), stats[0], stats[1], *out[3:])


def _check_fusion_layout(op: str, input_layout: str, query: object) -> bool:
    """The layouts the op takes and the two emulated; True for varlen (TND)."""
    if input_layout not in ("BSH", "SBH", "BSND", "BNSD", "TND"):
        raise _fail(op, f"input_layout={input_layout!r} is not one of BSH, SBH, BSND, BNSD, TND")
    if input_layout not in ("TND", "BSND"):
        raise NotEmulatedError(f"{op}: input_layout={input_layout!r} is valid but not emulated")
    if not isinstance(query, torch.Tensor):
        raise _fail(op, f"query must be a Tensor, got {type(query).__name__}")
    return input_layout == "TND"


def _fusion_tokens(
    op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, varlen: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int, int] | None]:
    """query, key and value as tokens [T, N, D] (one dtype), and for BSND (B, S, N, D: one
    batch per request, every S the same) its (B, Sq, Skv); None for TND."""
    dev = query.device
    dims = 3 if varlen else 4
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(op, name, t, dims, dev)
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32) or t.dtype != query.dtype:
            raise _fail(
                op,
                f"query, key, value must share one of float16/bfloat16/float32, "
                f"got {query.dtype}, {key.dtype}, {value.dtype}",
            )
    if varlen:
        return query, key, value, None
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        raise _fail(op, "query, key and value must share their batch size B")
    bsnd = (query.shape[0], query.shape[1], key.shape[1])
    query, key, value = (t.reshape(-1, *t.shape[2:]) for t in (query, key, value))
    return query, key, value, bsnd


def _check_fusion_heads(
    op: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    sink: torch.Tensor | None,
) -> None:
    """Heads and head sizes of the tokens [T, N, D], and the sink (one logit per head)."""
    _, num_heads, head_dim = query.shape
    if num_heads != head_num:
        raise _fail(op, f"head_num={head_num} but the query has {num_heads} heads")
    if (
        key.shape[:2] != value.shape[:2]
        or key.shape[2] != head_dim
        or value.shape[2] > head_dim
        or num_heads % key.shape[1]
    ):
        # "Dq=Dk和Dk≥Dv" [doc]: the value head size may be smaller
        raise _fail(
            op,
            f"key must be [T_kv, N_kv, {head_dim}] and value [T_kv, N_kv, Dv <= {head_dim}] "
            f"with N/N_kv an integer, got {list(key.shape)} and {list(value.shape)}",
        )
    if num_heads > 256 or not 1 <= head_dim <= 768:
        raise _fail(op, f"N={num_heads} (1..256) or D={head_dim} (1..768) out of range")
    if sink is not None:
        # "每个注意力头的偏置。shape为[head_num]，数据类型仅支持float32" (CANN 8.5.0+); the doc's
        # reference appends it as one more logit per row and drops its column [doc]
        if not isinstance(sink, torch.Tensor) or tuple(sink.shape) != (head_num,):
            raise _fail(op, f"sink must be a Tensor of shape [head_num={head_num}]")
        if sink.dtype != torch.float32:
            raise _fail(op, f"sink must be float32, got {sink.dtype}")
        if sink.device != query.device:
            raise _fail(op, f"sink is on {sink.device}, query on {query.device}")


def _fusion_lengths(
    op: str,
    total: int,
    kv_total: int,
    bsnd: tuple[int, int, int] | None,
    actual_seq_qlen: Sequence[int] | None,
    actual_seq_kvlen: Sequence[int] | None,
) -> tuple[list[int], list[int]]:
    """Each request's query and K/V lengths: BSND's S, or TND's cumulative ends."""
    if bsnd is not None:
        batch, q_s, kv_s = bsnd
        return [q_s] * batch, [kv_s] * batch
    q_ends = _int_list(op, "actual_seq_qlen", actual_seq_qlen, required=True)
    kv_ends = _int_list(op, "actual_seq_kvlen", actual_seq_kvlen, required=True)
    assert q_ends is not None and kv_ends is not None
    if len(q_ends) != len(kv_ends):
        raise _fail(
            op, f"actual_seq_qlen has {len(q_ends)} entries, actual_seq_kvlen {len(kv_ends)}"
        )
    if not 1 <= len(q_ends) <= FA_VARLEN_MAX_BATCH:
        raise _fail(op, f"varlen batch of {len(q_ends)}: 1..{FA_VARLEN_MAX_BATCH} supported")
    for name, rows in (("query", total), ("key", kv_total)):
        if not 1 <= rows <= FA_VARLEN_MAX_T:
            raise _fail(op, f"varlen {name} T = {rows}: 1..{FA_VARLEN_MAX_T} (1M) supported")
    q_lens = _cumulative(op, "actual_seq_qlen", q_ends, total, trailing_zeros=True)
    kv_lens = _cumulative(op, "actual_seq_kvlen", kv_ends, kv_total, trailing_zeros=True)
    return q_lens, kv_lens


def _fusion_masks(
    op: str,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
    pre_tockens: int,
    next_tockens: int,
    q_lens: list[int],
    kv_lens: list[int],
    dev: torch.device,
    *,
    varlen: bool,
) -> list[torch.Tensor | None]:
    """Each request's visible keys ([q_len, kv_len] bool, None = all) from ``sparse_mode``,
    its mask and band; a query row that sees no key is refused in varlen [doc]."""
    if sparse_mode not in range(9):
        raise _fail(op, f"sparse_mode={sparse_mode} is not one of 0..8")
    full: torch.Tensor | None = None  # sparse_mode 0 with a mask: [B or 1, Sq, Skv] bool
    if atten_mask is None:
        sparse_mode = 0  # no mask: sparse_mode / pre / next have no effect
    elif sparse_mode in (2, 3, 4):
        # bool / uint8 only (not FIA's int8), and varlen takes only the SS (2-D) form [doc]
        _check_compressed_mask(
            op, atten_mask, sparse_mode, dev, FA_MASK_DTYPES, ((MASK_SIZE, MASK_SIZE),)
        )
    elif sparse_mode == 0:
        full = _full_mask(op, atten_mask, q_lens, kv_lens, varlen, dev)
    else:
        raise NotEmulatedError(f"{op}: sparse_mode={sparse_mode} with a mask is not emulated")
    if sparse_mode == 4 and pre_tockens + next_tockens < 0:
        raise _fail(op, "band: pre_tockens and next_tockens must overlap")

    masks: list[torch.Tensor | None] = []
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        visible: torch.Tensor | None
        if full is not None:
            # defaultMask: the mask's top-left [q_len, kv_len] corner, within the band of
            # pre_tockens / next_tockens, which "需保证atten_mask与pre_tockens、next_tockens的范围
            # 一致" [doc]. The band is anchored bottom-right as sparse_mode 4's ("参数起点为右
            # 下角") [inferred for mode 0: it makes an Ascend vLLM backend's chunked-prefill
            # call (a bottom-right causal mask with pre_tockens=kv_len, next_tockens=0)
            # consistent, as the doc requires; with q_len = kv_len both anchors agree].
            band = _visible(q_len, kv_len, 4, pre_tockens, next_tockens)
            assert band is not None
            visible = ~full[b if full.shape[0] > 1 else 0, :q_len, :kv_len].cpu() & band
        else:
            visible = _visible(q_len, kv_len, sparse_mode, pre_tockens, next_tockens)
        empty = q_len and (kv_len == 0 or (visible is not None and not visible.any(dim=1).all()))
        if empty and varlen:
            # "atten_mask中不能存在某一行全1的场景" (varlen) [doc]
            raise _fail(op, "varlen: a query row sees no key (fully masked rows are unsupported)")
        masks.append(visible)
    return masks


def _full_mask(
    op: str,
    mask: object,
    q_lens: list[int],
    kv_lens: list[int],
    varlen: bool,
    device: torch.device,
) -> torch.Tensor:  # [B or 1, Sq, Skv] bool, True = masked
    """sparse_mode 0's full mask: bool / uint8; varlen "只支持SS格式，SS分别是maxSq和maxSkv"; else
    BNSS, B1SS, 11SS or SS [doc], and the 3-D (1 or B, Sq, Skv) an Ascend vLLM backend passes
    (``causal_mask.unsqueeze(0)``) [callers]. A mask per head (BNSS with N > 1) is not
    emulated."""
    if not isinstance(mask, torch.Tensor):
        raise _fail(op, f"atten_mask must be a Tensor, got {type(mask).__name__}")
    if mask.dtype not in FA_MASK_DTYPES:
        raise _fail(op, f"atten_mask must be bool or uint8, got {mask.dtype}")
    if mask.device != device:
        raise _fail(op, f"atten_mask is on {mask.device}, query on {device}")
    max_q, max_kv = max(q_lens, default=0), max(kv_lens, default=0)
    if varlen:
        if tuple(mask.shape) != (max_q, max_kv):
            raise _fail(
                op,
                f"varlen takes atten_mask as SS = [maxSq={max_q}, maxSkv={max_kv}], got "
                f"{list(mask.shape)}",
            )
        return mask.bool()[None]
    batch = len(q_lens)
    shape = tuple(mask.shape)
    if mask.dim() == 4 and shape[1] != 1:
        raise NotEmulatedError(f"{op}: a mask per head (BNSS) is not emulated")
    m = mask.reshape(-1, *shape[-2:]) if mask.dim() >= 3 else mask[None]
    if m.shape[0] not in (1, batch) or tuple(m.shape[1:]) != (max_q, max_kv):
        raise _fail(
            op,
            f"atten_mask must be BNSS, B1SS, 11SS or SS over [Sq={max_q}, Skv={max_kv}], got "
            f"{list(shape)}",
        )
    return m.bool()


def _fusion_attention_null(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    q_lens: list[int],
    kv_lens: list[int],
    masks: list[torch.Tensor | None],
    softmax_layout: str,
    seed: int,
    offset: int,
    sink: torch.Tensor | None = None,
    correct_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    total, num_heads, _ = query.shape
    dev = query.device
    stats = (total, num_heads, 8) if softmax_layout == "TND" else (num_heads, total, 8)
    return (
        emulation.preallocated((total, num_heads, value.shape[2]), query.dtype, dev),
        emulation.preallocated(stats, torch.float32, dev),
        emulation.preallocated(stats, torch.float32, dev),
        emulation.preallocated((0,), query.dtype, dev),
        seed,
        offset,
        0,
    )


@emulation.kernel(null=_fusion_attention_null)
def _fusion_attention_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    q_lens: list[int],
    kv_lens: list[int],
    masks: list[torch.Tensor | None],
    softmax_layout: str,
    seed: int,
    offset: int,
    sink: torch.Tensor | None = None,
    correct_empty: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """npu_fusion_attention's math, every argument checked (``masks``: each request's
    visibility, None: every key)."""
    total, num_heads, _ = query.shape
    dev = query.device
    out = query.new_empty(total, num_heads, value.shape[2])
    row_max = torch.empty(total, num_heads, dtype=torch.float32, device=dev)
    row_sum = torch.empty(total, num_heads, dtype=torch.float32, device=dev)
    qs = ks = 0
    for q_len, kv_len, visible in zip(q_lens, kv_lens, masks, strict=True):
        if q_len == 0:  # an empty batch, or one of the trailing batches left out
            ks += kv_len
            continue
        o, lse = _attend(
            query[qs : qs + q_len],
            key[ks : ks + kv_len],
            value[ks : ks + kv_len],
            scale,
            visible,
            sink,
            correct_empty,
        )
        out[qs : qs + q_len] = o.to(query.dtype)
        # softmax_max / softmax_sum: sum = exp(lse - max) with max the row's largest score
        m = _row_max(query[qs : qs + q_len], key[ks : ks + kv_len], scale, visible)
        row_max[qs : qs + q_len] = m
        row_sum[qs : qs + q_len] = torch.exp(lse - m)
        qs += q_len
        ks += kv_len
    # The kernel keeps 8 copies of each per-row statistic [inferred]; layout NTD unless 'TND'.
    stats = [t[..., None].expand(total, num_heads, 8).contiguous() for t in (row_max, row_sum)]
    if softmax_layout != "TND":
        stats = [t.permute(1, 0, 2).contiguous() for t in stats]
    reserved = torch.empty(0, dtype=query.dtype, device=dev)
    return out, stats[0], stats[1], reserved, seed, offset, 0


def _row_max(
    q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None
) -> torch.Tensor:  # [q_len, N] f32: max visible score per row
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    s = torch.einsum("ihd,jhd->hij", q.float(), kk) * scale
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    return s.amax(dim=-1).T


# --- KV-cache write (ATB) -------------------------------------------------------------------------


def _reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    """Write key [T, KV_N, Dk] / value [T, KV_N, Dv] row t to slot ``slot_indices[t]`` of caches
    [num_blocks, block_size, KV_N, Dk / Dv] (slot = block * block_size + offset); K and V head
    sizes may differ (ATB's ReshapeAndCache takes them separately). ``slot_indices`` must be
    int32; slots < 0 are skipped (padding). Returns nothing (mutates the caches).

    ``key``, ``value`` and ``slot_indices`` may be strided: the torch_npu wrapper hands every
    input to ATB as ``tensor.contiguous()`` (``ParamSetter::Input``); the caches are written
    through as outputs, so they must be contiguous [source: op-plugin
    ops/atb/ReshapeAndCachAtb.cpp, utils/custom_functions/atb/AtbCommon.cpp]."""
    op = "_npu_reshape_and_cache"
    for name, t in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_indices", slot_indices),
    ):
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
    if slot_indices.dtype != torch.int32:
        raise _fail(op, f"slot_indices must be int32, got {slot_indices.dtype}")
    if (
        slot_indices.dim() != 1
        or key.dim() != 3
        or value.dim() != 3
        or key.shape[:2] != value.shape[:2]
    ):
        raise _fail(
            op,
            f"key/value must be [T, KV_N, Dk] / [T, KV_N, Dv] and slot_indices [T], got "
            f"{list(key.shape)}, {list(value.shape)}, {list(slot_indices.shape)}",
        )
    if slot_indices.shape[0] != key.shape[0]:
        raise _fail(
            op, f"slot_indices has {slot_indices.shape[0]} entries, key {key.shape[0]} rows"
        )
    _check_bsnd_caches(op, key, value, key_cache, value_cache, "caches")
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise _fail(op, "key/value dtypes must match the caches'")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise _fail(op, "the caches must be contiguous")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_indices)}
    if len(devices) != 1:
        raise _fail(op, f"tensors on several devices: {sorted(map(str, devices))}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    keep = slots >= 0
    if bool((slots >= num_slots).any()):
        raise _fail(op, f"a slot index is >= the cache's {num_slots} slots")
    _write_slots(key, value, key_cache, value_cache, slots, keep.nonzero()[:, 0])


@emulation.kernel(null=emulation.skip)
def _write_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [T] int64, every one checked
    rows: torch.Tensor | None,  # the rows to write (None: every row)
) -> None:
    """The KV write both cache ops share: row ``rows[i]`` to slot ``slots[rows[i]]``."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if rows is not None:
        slots, key, value = slots[rows], key[rows], value[rows]
    for src, dst in ((key, key_cache), (value, value_cache)):
        dst.view(num_slots, *dst.shape[2:]).index_copy_(0, slots, src)


def _scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    compress_lens: torch.Tensor | None = None,
    compress_seq_offsets: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cache_mode: str | None = "PA_NZ",
) -> None:
    """The KV-cache write of A2/A3 (vllm-ascend's, with ``cache_mode="Norm"``): key
    [T, KV_N, Dk] / value [T, KV_N, Dv] row t to slot ``slot_mapping[t]`` of ND caches
    [num_blocks, block_size, KV_N, Dk / Dv]. ``slot_mapping`` is int32 or int64, every value in
    [0, num_blocks * block_size - 1] [doc]: there is no padding slot, the caller passes only
    rows to write. Returns nothing (mutates the caches)."""
    op = "npu_scatter_pa_kv_cache"
    _not_emulated(
        op,
        compress_lens=compress_lens,
        compress_seq_offsets=compress_seq_offsets,
        seq_lens=seq_lens,
    )
    if cache_mode not in (None, "Norm", "PA_NZ"):
        raise _fail(op, f"cache_mode={cache_mode!r} is not one of None, 'Norm', 'PA_NZ'")
    if cache_mode == "PA_NZ":
        raise NotEmulatedError(f"{op}: cache_mode='PA_NZ' (NZ caches) is valid but not emulated")
    tensors = (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    )
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise _fail(op, f"{name} must be a Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise _fail(op, f"{name} must be contiguous (non-contiguous inputs are unsupported)")
    if key.dim() == 4:
        raise NotEmulatedError(f"{op}: 4-D key/value (the compressed scenario) is not emulated")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise _fail(op, f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise _fail(
            op,
            f"3-D key/value must share their first two dims [T, KV_N], got {list(key.shape)} "
            f"and {list(value.shape)}",
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise _fail(
            op,
            f"slot_mapping must be [T={key.shape[0]}], got {list(slot_mapping.shape)}",
        )
    _check_bsnd_caches(op, key, value, key_cache, value_cache, "Norm caches")
    if len({t.dtype for t in (key, value, key_cache, value_cache)}) != 1:
        raise _fail(op, "key, value, key_cache and value_cache must share one dtype")
    devices = {t.device for _, t in tensors}
    if len(devices) != 1:
        raise _fail(op, f"tensors on several devices: {sorted(map(str, devices))}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    if slots.numel() and bool(((slots < 0) | (slots >= num_slots)).any()):
        bad = int(((slots < 0) | (slots >= num_slots)).nonzero()[0, 0])
        raise _fail(
            op,
            f"slot_mapping[{bad}] = {int(slots[bad])} is outside [0, {num_slots - 1}] (no "
            "padding slot: pass only the rows to write)",
        )
    _write_slots(key, value, key_cache, value_cache, slots, None)


# --- the namespace -------------------------------------------------------------------------------

npu_fused_infer_attention_score = OpPacket("npu_fused_infer_attention_score", _fia_v1, _fia_v1_out)
npu_fused_infer_attention_score_v2 = OpPacket(
    "npu_fused_infer_attention_score_v2", _fia_v2, _fia_v2_out
)
npu_fusion_attention = OpPacket("npu_fusion_attention", _npu_fusion_attention)
_npu_reshape_and_cache = OpPacket("_npu_reshape_and_cache", _reshape_and_cache)
npu_scatter_pa_kv_cache = OpPacket("npu_scatter_pa_kv_cache", _scatter_pa_kv_cache)
_npu_fused_infer_attention_score_get_max_workspace = OpPacket(
    "_npu_fused_infer_attention_score_get_max_workspace", _fia_v1_max_workspace
)
_npu_fused_infer_attention_score_v2_get_max_workspace = OpPacket(
    "_npu_fused_infer_attention_score_v2_get_max_workspace", _fia_v2_max_workspace
)

#: Every emulated op, by the name ``torch_npu`` exposes it under.
OPS: dict[str, OpPacket] = {
    p.__name__: p
    for p in (
        npu_fused_infer_attention_score,
        npu_fused_infer_attention_score_v2,
        npu_fusion_attention,
        _npu_reshape_and_cache,
        npu_scatter_pa_kv_cache,
        _npu_fused_infer_attention_score_get_max_workspace,
        _npu_fused_infer_attention_score_v2_get_max_workspace,
    )
}


def __getattr__(name: str) -> Any:
    """``atb``: the emulated ``torch_npu.atb`` namespace (``emulator_atb``), loaded on first use
    (it imports this module's helpers)."""
    if name == "atb":
        import importlib

        return importlib.import_module(f"{__package__}.emulator_atb").namespace
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
