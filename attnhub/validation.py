"""What a valid attention call is. Every check runs before anything is written, so a rejected
call leaves the KV cache byte-identical. Errors are InvalidInputError naming the bad value.

Per step, ``build`` reads the batch's host copies once (:func:`check_step`): every slot is -1 or
a slot, every block a request reads is a block, and the largest of each is remembered. Per layer,
``forward`` and ``write_kv(meta=)`` compare those two numbers with the cache's size
(:func:`check_extents`): O(1), no tensor read, so no device-to-host sync ever.

Each rule is written once, as data (:class:`Rule`: a condition over the call's facts and the
error naming the value that breaks it), in tables (:class:`Rules`) read two ways: one compiled
pass over every condition for the usual call, and the same conditions one by one to word the
first that fails.

A step's full checks run through one more table where attnhub-speedups (an optional C
extension, ``attnhub[speedups]``) is installed: :data:`FAST_STEP`, the structure rules and one
compiled call for every length and value rule; a step it does not clear is decided and worded
by :data:`STEP`, so verdicts, errors and facts are the same with or without it. Where its C++
part is built against this torch, a step's structure and dense-batch test are one compiled
call too (:func:`checked_step`, :func:`checked_structure`), on the same terms.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from types import FunctionType
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from attnhub.batch import BatchMetadata
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import TENSOR_SCALE_SHAPES, BlockPacking, PagedKVCache, scale_shape
from attnhub.spec import KV_CACHE_DTYPES, AttentionSpec

if TYPE_CHECKING:
    from attnhub.mla import LatentKVCache

_StepValues = Callable[..., "tuple[int, int, int, int, int] | None"]


def _installed_step_values() -> _StepValues | None:
    """attnhub-speedups' compiled step pass (attnhub[speedups]), None where it is not
    installed (or not built for this Python): the Python rules then decide alone
    (:func:`check_step`)."""
    try:
        from attnhub_speedups import step_values
    except ImportError:
        return None
    return cast(_StepValues, step_values)


_compiled_step_values = _installed_step_values()

_StepStructure = Callable[[object, object, torch.device], bool]


def _installed_step_structure() -> tuple[_StepStructure | None, str]:
    """attnhub-speedups' compiled structure pass (``step_structure(batch, block_size,
    device)``: the :data:`STRUCTURE` rules and :func:`dense_batch`'s test, read through
    torch's C++ API), and why it is not in use where it is None: not installed, not built (it
    is built only where torch is importable at build time), or built against another torch
    (it is tied to the torch it was compiled with)."""
    try:
        from attnhub_speedups import _step_structure
    except ImportError as exc:
        return None, f"attnhub_speedups._step_structure is not importable ({exc})"
    built_with = getattr(_step_structure, "TORCH_BUILT_WITH", None)
    if built_with != torch.__version__:
        return None, (
            f"attnhub_speedups._step_structure was built against torch {built_with}, this is "
            f"torch {torch.__version__}: rebuild attnhub-speedups (docs/install.md)"
        )
    _step_structure.bind(BatchMetadata)
    return _step_structure.step_structure, ""


_compiled_step_structure, STRUCTURE_PASS_MISSING = _installed_step_structure()


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


same_device = _same_device


def spec_differences(built_for: AttentionSpec, mine: AttentionSpec) -> str:
    """``"block_size 32 (this layer: 16), ..."``: the fields where two specs differ."""
    parts = [
        f"{f.name} {getattr(built_for, f.name)!r} (this layer: {getattr(mine, f.name)!r})"
        for f in fields(built_for)
        if getattr(built_for, f.name) != getattr(mine, f.name)
    ]
    return ", ".join(parts) or "equal fields, unequal specs"


def same_view(a: object, b: torch.Tensor) -> bool:
    """Whether ``a`` is a tensor viewing the same elements as ``b`` (e.g. another slice object
    of the same engine buffer). Reads no values."""
    return a is b or (
        isinstance(a, torch.Tensor)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


# --- rules: each condition written once, read two ways ------------------------------------------
#
# A rule is a condition over a call's facts (a Python expression) and the error that names the
# value breaking it. A table of rules is read two ways: ``passes`` joins every condition with
# ``and`` into one compiled function (the cost of the usual call: no function per rule, no error
# text), and ``explain`` evaluates the same expressions one by one, in the same order, to raise
# the first failing rule's error. A rule may rely on the ones before it (an ``isinstance``
# before an attribute). Where a condition fails, ``at`` (if given) finds the offending entry for
# the message; a rule with ``otherwise`` instead runs a check that raises its own error or
# accepts what the condition did not (another spelling of the same device, a cache that is
# checked once and remembered).


@dataclass(frozen=True)
class Rule:
    holds: str  # an expression over the table's facts, True when the rule holds
    says: str = ""  # f-string body over the facts (and ``at``): the error naming the value
    at: str = ""  # an expression locating the offending entry, evaluated only to word it
    otherwise: str = ""  # an expression that raises its own error or accepts (instead of says)


@dataclass(frozen=True)
class Let:
    """A fact derived on the way (``query.shape``, read once: each read of a tensor's shape
    costs ~0.15 us), for the rules after it."""

    name: str
    value: str  # an expression over the facts before it


def _first(mask: np.ndarray) -> Any:
    """The index of the first True entry of ``mask`` (an int, or a tuple for a 2-D mask)."""
    where = np.argwhere(mask)[0]
    return int(where[0]) if where.size == 1 else tuple(int(x) for x in where)


def _want(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _or(dtype: torch.dtype | tuple[torch.dtype, ...]) -> str:
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    return " or ".join(str(d) for d in dtypes)


class Rules:
    """A table of rules (and the facts derived between them) over the facts named in
    ``facts`` ("batch, spec, device")."""

    def __init__(
        self,
        facts: str,
        items: Sequence[Rule | Let],
        names: dict[str, Any] | None = None,
        *,
        returns: str = "True",
    ) -> None:
        self.items = tuple(items)
        self.rules = tuple(r for r in self.items if isinstance(r, Rule))
        self.facts = tuple(name.strip() for name in facts.split(","))
        #: What the expressions may name beyond the facts: this module's globals, and
        #: ``names`` (another module's classes, for its own tables).
        self.env = globals() if names is None else {**globals(), **names}
        lines = [f"def passes({facts}):"]
        for item in self.items:
            if isinstance(item, Let):
                lines.append(f"    {item.name} = {item.value}")
            else:
                lines.append(f"    if not ({item.holds}):\n        return False")
        lines.append(f"    return {returns}")
        scratch: dict[str, Any] = {}
        exec(compile("\n".join(lines) + "\n", f"<rules over {facts}>", "exec"), scratch)
        #: ``returns`` (True by default: what the facts give where every rule holds), False
        #: where one does not: one compiled function, no error text.
        self.passes: Any = FunctionType(scratch["passes"].__code__, self.env, "passes")
        self._returns = compile(returns, "<returns>", "eval")
        self._compiled = [
            (item.name, compile(item.value, "<let>", "eval"), None, None, None)
            if isinstance(item, Let)
            else (
                "",
                compile(item.holds, "<rule>", "eval"),
                compile(item.at, "<rule>", "eval") if item.at else None,
                compile("f" + repr(item.says), "<rule>", "eval") if item.says else None,
                compile(item.otherwise, "<rule>", "eval") if item.otherwise else None,
            )
            for item in self.items
        ]

    def explain(self, *facts: object) -> Any:
        """Raise the error of the first rule that does not hold (in order), else return what
        ``passes`` returns."""
        names: dict[str, Any] = dict(zip(self.facts, facts, strict=True))
        env = self.env
        for let, expr, at, says, otherwise in self._compiled:
            if let:
                value = eval(expr, env, names)
                if "," in let:  # "lo, hi": a tuple of facts
                    names.update(zip((n.strip() for n in let.split(",")), value, strict=True))
                else:
                    names[let] = value
                continue
            if eval(expr, env, names):
                continue
            if otherwise is not None:
                eval(otherwise, env, names)
                continue
            if at is not None:
                names["at"] = eval(at, env, names)
            assert says is not None
            raise InvalidInputError(eval(says, env, names))
        return eval(self._returns, env, names)

    def check(self, *facts: object) -> Any:
        """What ``passes`` returns where every rule holds, else the first failure's error."""
        return self.passes(*facts) or self.explain(*facts)


def tensor_rules(
    t: str,
    label: str,
    dims: Sequence[str | None],
    dtype: str,
    device: str,
    *,
    any_size: bool = False,
    like: str = "",
    dense_rows: bool = False,
) -> list[Rule | Let]:
    """A tensor argument's rules: ``t`` (its fact) is a tensor of shape ``dims`` (expressions;
    None = any size; with ``any_size`` each may evaluate to None; or the shape ``like`` names,
    one comparison), dtype ``dtype`` (an expression: one dtype or a tuple of them) on
    ``device``; with ``dense_rows``, its last dimension is dense (stride 1), as every attention
    kernel reads a head's vector (vendor kernels check for it): views of a fused QKV projection
    are, and any other stride is refused before anything is written.
    ``label`` names it in errors. Derives ``{t}_shape``."""
    shape = f"{t}_shape"
    sizes = [
        f"(({d}) is None or {shape}[{i}] == {d})" if any_size else f"{shape}[{i}] == {d}"
        for i, d in enumerate(dims)
        if d is not None
    ]
    want = "(" + "".join(f"{'None' if d is None else d}, " for d in dims) + ")"
    fits = " and ".join([f"len({shape}) == {len(dims)}", *sizes])
    if like:
        fits, want = f"{shape} == {like}", f"tuple({like})"
    rules: list[Rule | Let] = [
        Rule(
            f"isinstance({t}, torch.Tensor)",
            label + f" must be a torch.Tensor, got {{type({t}).__name__}}",
        ),
        Let(shape, f"{t}.shape"),
        Rule(
            fits,
            label + f" has shape {{list({shape})}}, expected {{_want({want})}}",
        ),
        Rule(
            f"{t}.dtype is {dtype} or (isinstance({dtype}, tuple) and {t}.dtype in {dtype})",
            label + f" has dtype {{{t}.dtype}}, expected {{_or({dtype})}}",
        ),
        Rule(
            f"{t}.device == {device} or same_device({t}.device, {device})",
            label + f" is on {{{t}.device}}, expected {{{device}}}",
        ),
    ]
    if dense_rows:
        rules.append(
            Rule(
                f"{t}.stride(-1) == 1 or {shape}[-1] == 1",
                label + f"'s last dimension is strided (strides {{{t}.stride()}}): each head's "
                "vector must be dense (stride 1), as attention kernels read it; pass a view "
                "whose last dimension is dense (a fused QKV projection's split is) or "
                ".contiguous()",
            )
        )
    return rules


def check_tensor(
    name: str,
    t: object,
    shape: tuple[int | None, ...],
    dtype: torch.dtype | tuple[torch.dtype, ...],
    device: torch.device,
) -> torch.Tensor:
    """``t`` is a tensor of ``shape`` (None = any size), ``dtype`` and ``device``: the rules of
    :func:`tensor_rules` for a shape known at the call."""
    table = _TENSOR_TABLES.get(len(shape))
    if table is None:
        dims = [f"shape[{i}]" for i in range(len(shape))]
        rules = tensor_rules("t", "{name}", dims, "dtype", "device", any_size=True)
        table = _TENSOR_TABLES[len(shape)] = Rules("name, t, shape, dtype, device", rules)
    if not table.passes(name, t, shape, dtype, device):
        table.explain(name, t, shape, dtype, device)
    assert isinstance(t, torch.Tensor)
    return t


_TENSOR_TABLES: dict[int, Rules] = {}


def check_cache(
    spec: AttentionSpec,
    layout: str,
    cache: PagedKVCache,
    device: torch.device,
    *,
    strided: bool = True,
    packing: BlockPacking | None = None,
) -> None:
    """The cache has this spec's geometry, storage dtypes, layout and scale planes; with
    ``strided=False`` (a backend whose kernels need it) each K/V plane is contiguous; its blocks
    are not packed, or packed as ``packing`` (the backend's own, ``AttentionBackend.kv_packing``)
    says."""
    if not isinstance(cache, PagedKVCache):
        raise InvalidInputError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if cache.layout != layout:
        raise InvalidInputError(f"cache layout is {cache.layout!r}, this backend uses {layout!r}")
    if cache.packing is not None and cache.packing != packing:
        theirs = "are not packed" if packing is None else f"are packed {packing.name}"
        raise InvalidInputError(
            f"cache blocks are packed {cache.packing.name}, this backend's kernels' blocks "
            f"{theirs} (allocate with backend.allocate_kv_cache)"
        )
    fmt = KV_CACHE_DTYPES[spec.kv_cache_dtype]
    slot_scales = tuple(w for w in ("key_scale", "value_scale") if getattr(fmt, w) == "slot")
    check_planes_written_in_place(cache, ("key", "value", *slot_scales))
    if cache.kv_cache_dtype != spec.kv_cache_dtype:
        raise InvalidInputError(
            f"cache kv_cache_dtype is {cache.kv_cache_dtype!r}, the spec says "
            f"{spec.kv_cache_dtype!r}"
        )
    if cache.block_size != spec.block_size:
        raise InvalidInputError(
            f"cache block_size is {cache.block_size}, the spec says {spec.block_size}"
        )
    if (cache.num_kv_heads, cache.head_size) != (spec.num_kv_heads, spec.head_size):
        raise InvalidInputError(
            f"cache holds {cache.num_kv_heads} kv heads of size {cache.head_size}, the spec "
            f"says {spec.num_kv_heads} of size {spec.head_size}"
        )
    if cache.head_size_v != spec.head_size_v:
        raise InvalidInputError(
            f"cache holds values of head size {cache.head_size_v}, the spec says "
            f"head_size_v = {spec.head_size_v}"
        )
    kdt, vdt = KV_CACHE_DTYPES[spec.kv_cache_dtype].storage_dtypes(spec.dtype)
    if cache.key.dtype != kdt or cache.value.dtype != vdt:
        raise InvalidInputError(
            f"cache stores {cache.key.dtype}/{cache.value.dtype}, kv_cache_dtype "
            f"{spec.kv_cache_dtype!r} needs {kdt}/{vdt}"
        )
    if not _same_device(cache.device, device):
        raise InvalidInputError(f"cache is on {cache.device}, expected {device}")
    if not strided and not (cache.key.is_contiguous() and cache.value.is_contiguous()):
        raise InvalidInputError(
            "this backend's kernels need contiguous key and value planes (capabilities."
            f"strided_kv_cache is False); got strides {cache.key.stride()} / "
            f"{cache.value.stride()} (allocate with backend.allocate_kv_cache, or lay K and V out "
            "as two planes)"
        )
    for which in ("key_scale", "value_scale"):
        if getattr(fmt, which) != "none" and getattr(cache, which) is None:
            raise InvalidInputError(
                f"kv_cache_dtype {spec.kv_cache_dtype!r} needs cache.{which}, which is None"
            )
        _check_scale(spec, cache, which, getattr(fmt, which))


def check_planes_written_in_place(cache: object, names: tuple[str, ...]) -> None:
    """None of the cache's planes of these names (those KV writes write) requires grad: the
    writes are in place, which torch refuses for a tensor that requires grad under grad mode,
    after another plane may have been written (a half-written cache and an untyped
    RuntimeError)."""
    for name in names:
        t = getattr(cache, name, None)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise InvalidInputError(
                f"cache.{name} requires grad: a KV cache is written in place, which torch "
                "refuses for a tensor that requires grad; make its planes with "
                f"requires_grad=False (or call cache.{name}.requires_grad_(False))"
            )


def _check_scale(spec: AttentionSpec, cache: PagedKVCache, which: str, kind: str) -> None:
    """A quantized cache's scale (engines attach their own) is what its kind says: float32 on
    the cache's device, one element ("tensor": ``()`` or ``(1,)``), ``(num_kv_heads, the
    plane's head size)`` ("channel") or one per slot and kv head (``cache.key.shape[:3]``,
    "slot"); a kernel would otherwise broadcast it wrongly, or fail after the other plane was
    written."""
    scale = getattr(cache, which)
    if kind == "none" or scale is None:
        return
    name, kv = f"cache.{which}", spec.kv_cache_dtype
    width = spec.head_size if which == "key_scale" else spec.head_size_v
    want = scale_shape(
        kind, cache.num_blocks, spec.block_size, spec.num_kv_heads, width, cache.layout
    )
    if not isinstance(scale, torch.Tensor):
        raise InvalidInputError(
            f"{name} must be a float32 tensor {want} for kv_cache_dtype {kv!r}, got "
            f"{type(scale).__name__}"
        )
    shape = tuple(scale.shape)
    if scale.dtype != torch.float32 or not (
        shape == want or (kind == "tensor" and shape in TENSOR_SCALE_SHAPES)
    ):
        raise InvalidInputError(
            f"{name} must be float32 {want}{' (or (1,))' if kind == 'tensor' else ''} for "
            f"kv_cache_dtype {kv!r}, got {scale.dtype} {shape}"
        )
    if not _same_device(scale.device, cache.device):
        raise InvalidInputError(f"{name} is on {scale.device}, the cache on {cache.device}")


def tensor_scale_names(spec: AttentionSpec) -> tuple[str, ...]:
    """The cache's per-tensor ("tensor" kind: fp8) scale planes of this spec, by name."""
    fmt = KV_CACHE_DTYPES[spec.kv_cache_dtype]
    return tuple(w for w in ("key_scale", "value_scale") if getattr(fmt, w) == "tensor")


#: How many tensor states (``tensor_state``) a :class:`CheckedStates` remembers before it forgets
#: them all: one per layer an impl serves, times the scale changes an engine makes.
SCALES_REMEMBERED = 1024


def tensor_state(t: torch.Tensor | None) -> object:
    """What identifies a tensor's values without reading them: its storage and torch version
    counter (bumped by every in-place change; an inference tensor, made under
    ``torch.inference_mode``, has none: its storage alone, so an in-place change of it inside
    inference mode is not seen)."""
    return None if t is None else (t.data_ptr(), None if t.is_inference() else t._version)


def tensor_scale_key(
    cache: PagedKVCache | LatentKVCache, names: tuple[str, ...]
) -> tuple[object, ...]:
    """The states (``tensor_state``) of the cache's scale planes of these names."""
    return tuple(tensor_state(getattr(cache, name)) for name in names)


class CheckedStates:
    """The states of tensors whose values a check found good (keys made of ``tensor_state``),
    so that the check reads values on the host only when they change, not per step. A set, as
    one impl may serve several layers' caches in turn; bounded: past ``bound`` states (an
    engine replacing scales step after step) it forgets them all and checks afresh."""

    __slots__ = ("_seen", "bound")

    def __init__(self, bound: int = SCALES_REMEMBERED) -> None:
        self._seen: set[object] = set()
        self.bound = bound

    def __contains__(self, key: object) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, key: object) -> None:
        if len(self._seen) >= self.bound:
            self._seen.clear()
        self._seen.add(key)


def check_tensor_scale_values(cache: PagedKVCache | LatentKVCache, names: tuple[str, ...]) -> None:
    """Each per-tensor (fp8) scale is finite and non-zero: keys and values are stored as
    ``fp8(x / scale)`` and read back as ``fp8 * scale``, so a zero scale reads every value back
    as 0 (and stores a zero input as NaN), an infinite one reads NaN, a NaN one NaN, silently.
    (A negative scale round-trips, the formats being sign-symmetric.) Reads the values on the
    host: call it when they may have changed (``tensor_scale_key``), not per step."""
    for name in names:
        t = getattr(cache, name)
        if t is None or t.device.type == "meta":  # no values to read on a stand-in device
            continue
        v = float(t.detach().reshape(()).to("cpu", torch.float64))
        if not math.isfinite(v) or v == 0.0:
            raise InvalidInputError(
                f"cache.{name} = {v} must be finite and non-zero for kv_cache_dtype "
                f"{cache.kv_cache_dtype!r}: the cache stores fp8(x / scale) and reads back "
                "fp8 * scale, which this scale turns into zeros or NaN"
            )


#: New keys and values: [n >= num_slots, num_kv_heads, head_size] in the model dtype (values
#: head_size_v wide), over the facts (spec, key, value, device, num_slots).
KV_RULES = [
    *tensor_rules(
        "key",
        "key",
        [None, "spec.num_kv_heads", "spec.head_size"],
        "spec.dtype",
        "device",
        dense_rows=True,
    ),
    *tensor_rules(
        "value",
        "value",
        [None, "spec.num_kv_heads", "spec.head_size_v"],
        "spec.dtype",
        "device",
        dense_rows=True,
    ),
    Rule(
        "key_shape[0] == value_shape[0]",
        "key has {key_shape[0]} tokens but value has {value_shape[0]}",
    ),
    Rule(
        "key_shape[0] >= num_slots",
        "key has {key_shape[0]} tokens but slot_mapping has {num_slots} entries",
    ),
]
KV = Rules("spec, key, value, device, num_slots", KV_RULES)


def check_kv(
    spec: AttentionSpec, key: object, value: object, device: torch.device, num_slots: int
) -> None:
    """New keys/values: [n >= num_slots, num_kv_heads, head_size (values: head_size_v)] in the
    model dtype."""
    if not KV.passes(spec, key, value, device, num_slots):
        KV.explain(spec, key, value, device, num_slots)


def _slot_outside(i: int, slot: int, cache: PagedKVCache) -> str:
    return (
        f"slot_mapping[{i}] = {slot} is outside the cache "
        f"({cache.num_blocks} blocks x {cache.block_size} slots)"
        + ("; use -1 for padding" if slot < 0 else "")
    )


def _duplicate(slots: np.ndarray) -> tuple[int, int, int]:
    """Two tokens writing one slot: their rows and the slot (there is one)."""
    written = slots[slots >= 0]
    ordered = np.sort(written)
    slot = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
    i, j = (int(x) for x in np.flatnonzero(slots == slot)[:2])
    return i, j, slot


def _in_use(seq: np.ndarray, block_size: int, width: int) -> np.ndarray:  # [B, width] bool
    """Which block-table entries the requests read (their first ceil(seq_len / block_size))."""
    used = (seq.astype(np.int64) + block_size - 1) // block_size
    return np.arange(width)[None, :] < used[:, None]


# The step's slots, over the facts (slots, lo, hi, dup): the host slot mapping, its extremes,
# whether two written entries are equal (:func:`_slot_facts`).
SLOT_FACTS = Let("lo, hi, dup", "_slot_facts(slots)")
SLOT_NOT_BELOW_PADDING = Rule(
    "lo >= -1",
    "slot_mapping[{at}] = {int(slots[at])} is not a slot; use -1 for padding",
    at="_first(slots < -1)",
)
SLOTS_DISTINCT = Rule(
    "not dup",
    "slot_mapping[{at[0]}] and slot_mapping[{at[1]}] are both {at[2]}: two tokens of one step "
    "would write the same cache slot (do two requests' blocks overlap?)",
    at="_duplicate(slots)",
)
#: Every slot is -1 or inside ``cache``.
SLOT_IN_CACHE = Rule(
    "lo >= -1 and hi < cache.num_slots",
    "{_slot_outside(at, int(slots[at]), cache)}",
    at="_first((slots < -1) | (slots >= cache.num_slots))",
)
# The blocks a request reads (facts seq, block_size, table; top: the largest entry read as
# unsigned, largest: the largest a table without a negative entry has: :func:`_block_facts`).
BLOCK_FACTS = Let("top, largest", "_block_facts(table)")
BLOCKS_NOT_NEGATIVE = Rule(
    "top <= largest or not _OR(_in_use(seq, block_size, table.shape[1]) & (table < 0), None)",
    "block_table[{at[0]}, {at[1]}] = {int(table[at])} is negative",
    at="_first(_in_use(seq, block_size, table.shape[1]) & (table < 0))",
)
BLOCK_IN_CACHE = Rule(
    "top < cache.num_blocks or not "
    "_OR(_in_use(seq, block_size, table.shape[1]) & (table >= cache.num_blocks), None)",
    "block_table[{at[0]}, {at[1]}] = {int(table[at])} is outside the cache "
    "({cache.num_blocks} blocks)",
    at="_first(_in_use(seq, block_size, table.shape[1]) & (table >= cache.num_blocks))",
)
# Lengths (facts qlens, seq, ctx = seq - qlens, lo_q, lo_c, hi_s: their extremes, block_size,
# width: the block table's).
QUERY_LENS_POSITIVE = Rule(
    "lo_q >= 1", "query_lens[{at}] = {int(qlens[at])} must be >= 1", at="_first(qlens < 1)"
)
SEQ_COVERS_QUERY = Rule(
    "lo_c >= 0",
    "seq_lens[{at}] = {int(seq[at])} is less than query_lens[{at}] = {int(qlens[at])}",
    at="_first(ctx < 0)",
)
TABLE_WIDE_ENOUGH = Rule(
    "-(-hi_s // block_size) <= width",
    "block_table has {width} blocks per request, but request {at} has seq_len {int(seq[at])} "
    "= {-(-int(seq[at]) // block_size)} blocks of {block_size}",
    at="_first(-(-seq // block_size) > width)",
)

#: What ``BatchMetadata.from_lengths`` is given (its lengths and table as numpy, a request or
#: more).
GIVEN_LENGTHS = Rules(
    "qlens, seq, table, block_size",
    [
        Let("ctx", "_SUB(seq, qlens, dtype=_I64)"),
        Let("lo_q", "int(_MIN(qlens))"),
        Let("lo_c", "int(_MIN(ctx))"),
        Let("hi_s", "int(_MAX(seq))"),
        Let("width", "table.shape[1]"),
        QUERY_LENS_POSITIVE,
        SEQ_COVERS_QUERY,
        TABLE_WIDE_ENOUGH,
        BLOCK_FACTS,
        BLOCKS_NOT_NEGATIVE,
    ],
)


def _with_requests(items: list[Rule | Let]) -> list[Rule | Let]:
    """``items`` for a batch that may have no request (a rule holds, a fact is None, there)."""
    return [
        Let(
            r.name,
            f"{'(None,) * ' + str(r.name.count(',') + 1) if ',' in r.name else 'None'} "
            f"if not B else ({r.value})",
        )
        if isinstance(r, Let)
        else Rule(f"not B or ({r.holds})", r.says, r.at, r.otherwise)
        for r in items
    ]


#: A batch's integer tensors (facts named as the fields) hold int32 or int64.
INT_TENSOR = {
    name: Rule(
        f"{name}.dtype in INT_DTYPES", f"{name} must be int32 or int64, got {{{name}.dtype}}"
    )
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
}
#: The block table has a row per request (B of them).
TABLE_SHAPE = Rule(
    "block_table.ndim == 2 and block_table.shape[0] == B",
    "block_table must be [num_reqs={B}, max_blocks], got shape {tuple(block_table.shape)}",
)
#: The table ``BatchMetadata.from_lengths`` is given, for B requests.
GIVEN_TABLE = Rules("block_table, B", [TABLE_SHAPE, INT_TENSOR["block_table"]])

#: A batch's kind, shapes, dtypes and devices, for a spec on ``device``: O(1), no value read.
#: Facts (batch, spec, device).
STRUCTURE: list[Rule | Let] = [
    Rule(
        "isinstance(batch, BatchMetadata)",
        "batch must be a BatchMetadata, got {type(batch).__name__}",
    ),
    Rule(
        "batch.block_size == spec.block_size",
        "batch block_size is {batch.block_size}, the spec says {spec.block_size}",
    ),
    *(Let(name, f"batch.{name}") for name in INT_TENSOR),
    Let("dev", "query_start_loc.device"),
    Rule(
        "dev == device or same_device(dev, device)",
        "batch tensors are on {dev}, expected {device}",
    ),
    Let("B", "batch.num_reqs"),
    Rule(
        "batch.query_start_loc_cpu.shape == (B + 1,)",
        "query_start_loc must have num_reqs + 1 = {B + 1} entries, got shape "
        "{tuple(batch.query_start_loc_cpu.shape)}",
    ),
    Rule(
        "batch.seq_lens_cpu.shape == (B,)",
        "seq_lens must have num_reqs = {B} entries, got shape {tuple(batch.seq_lens_cpu.shape)}",
    ),
    # the device tensors too: a kernel reads B + 1 offsets and B lengths from them
    Rule(
        "query_start_loc.shape == (B + 1,)",
        "query_start_loc (the device tensor) must have num_reqs + 1 = {B + 1} entries, got "
        "shape {tuple(query_start_loc.shape)}",
    ),
    Rule(
        "seq_lens.shape == (B,)",
        "seq_lens (the device tensor) must have num_reqs = {B} entries, got shape "
        "{tuple(seq_lens.shape)}",
    ),
    *INT_TENSOR.values(),
    *(
        Rule(
            f"batch.{name}.dtype in INT_DTYPES and batch.{name}.is_cpu",
            f"{name} must be an int32 or int64 host (cpu) tensor, got "
            f"{{batch.{name}.dtype}} on {{batch.{name}.device}}",
        )
        for name in ("query_start_loc_cpu", "seq_lens_cpu")
    ),
    *(
        Rule(f"{name}.device == dev", f"{name} is on {{{name}.device}}, query_start_loc on {{dev}}")
        for name in ("seq_lens", "block_table", "slot_mapping")
    ),
    *(
        Rule(
            f"batch.{name}_cpu is None or (batch.{name}_cpu.shape == {name}.shape "
            f"and batch.{name}_cpu.is_cpu and batch.{name}_cpu.dtype in INT_DTYPES)",
            f"{name}_cpu must be an int32 or int64 host copy of {name} (shape "
            f"{{tuple({name}.shape)}}), got {{batch.{name}_cpu.dtype}} "
            f"{{tuple(batch.{name}_cpu.shape)}} on {{batch.{name}_cpu.device}}",
        )
        for name in ("block_table", "slot_mapping")
    ),
    TABLE_SHAPE,
    Rule(
        "B or batch.num_actual_tokens == 0",
        "num_actual_tokens = {batch.num_actual_tokens} but the batch has no request",
    ),
]

#: A step's lengths, on its host copies (after :data:`STRUCTURE`).
LENGTHS: list[Rule | Let] = _with_requests(
    [
        Let("qsl", "batch.query_start_loc_cpu.numpy()"),
        Let("seq", "batch.seq_lens_cpu.numpy()"),
        # in int64, exact: int32 differences would wrap (offsets [0, 2**31 - 1, -2**31] would
        # read as query lengths [2**31 - 1, 1], a sequence length of -2**31 as a context >= 0)
        Let("qlens", "_SUB(qsl[1:], qsl[:-1], dtype=_I64)"),
        Let("ctx", "seq - qlens"),
        Let("total", "int(qsl[-1])"),
        Let("hi_q", "int(_MAX(qlens))"),
        # the query lens sum to B times the longest: all equal (the usual decode step), so the
        # shortest is the longest and the shortest context is the shortest sequence's
        Let("uniform", "total - int(qsl[0]) == B * hi_q"),
        Let("lo_q", "hi_q if uniform else int(_MIN(qlens))"),
        Let("lo_c", "int(_MIN(seq)) - hi_q if uniform else int(_MIN(ctx))"),
        Let("hi_s", "int(_MAX(seq))"),
        Let("block_size", "batch.block_size"),
        Let("width", "block_table.shape[1]"),
        Rule("int(qsl[0]) == 0", "query_start_loc[0] = {int(qsl[0])} must be 0"),
        Rule(
            "lo_q >= 1",
            "query_start_loc is not strictly increasing: query_start_loc[{at}] = "
            "{int(qsl[at])}, query_start_loc[{at + 1}] = {int(qsl[at + 1])}",
            at="_first(qlens < 1)",
        ),
        SEQ_COVERS_QUERY,
        Rule(
            "total == batch.num_actual_tokens",
            "num_actual_tokens = {batch.num_actual_tokens} but query_start_loc[-1] = {total}",
        ),
        Rule(
            "slot_mapping.ndim == 1 and slot_mapping.shape[0] >= total",
            "slot_mapping has shape {tuple(slot_mapping.shape)}, needs at least {total} entries",
        ),
        TABLE_WIDE_ENOUGH,
        Rule(
            "hi_q == batch.max_query_len",
            "max_query_len = {batch.max_query_len} but the longest query is {hi_q}",
        ),
        Rule(
            "hi_s == batch.max_seq_len",
            "max_seq_len = {batch.max_seq_len} but the longest sequence is {hi_s}",
        ),
    ]
)

#: A step's slots and blocks (after its lengths).
VALUES: list[Rule | Let] = [
    Let("slots", "batch.host_slot_mapping().numpy()"),
    SLOT_FACTS,
    SLOT_NOT_BELOW_PADDING,
    SLOTS_DISTINCT,
    *_with_requests(
        [Let("table", "batch.host_block_table().numpy()"), BLOCK_FACTS, BLOCKS_NOT_NEGATIVE]
    ),
]

#: ``BatchMetadata.validate``, and a batch for a spec: structure and lengths.
BATCH = Rules("batch, spec, device", [*STRUCTURE, *LENGTHS])
#: Every check of a step; returns its extents and what was read on the way.
STEP = Rules(
    "batch, spec, device",
    [*STRUCTURE, *LENGTHS, *VALUES],
    returns="StepFacts("
    "max_slot=hi, "
    "max_block=-1 if not B else top if top <= largest else int(_MAX(table, None)), "
    "min_slot=lo, "
    "query_lens=qlens, "
    "seq_lens=seq, "
    "context_lens=ctx, "
    "min_query_len=lo_q or 0, "
    "min_context_len=lo_c or 0, "
    "query_start_locs=qsl, "
    "block_table=table)",
)
#: A step's structure alone (``values=False``).
STEP_STRUCTURE = Rules("batch, spec, device", STRUCTURE, returns="STRUCTURAL_FACTS")

#: The item size of a batch's integer dtypes (the structure rules admit these two only).
_ITEMSIZE = {torch.int32: 4, torch.int64: 8}
#: A step's lengths and values (:data:`LENGTHS`, :data:`VALUES`) in one compiled pass over
#: its host copies (attnhub-speedups' ``step_values``), read once the structure rules hold:
#: their data pointers, item sizes and counts, each proven by those rules (qsl [B + 1], seq
#: [B], the slot mapping 1-D, the table [B, width]). Anything unusual (a strided host copy, a
#: batch on an accelerator without its host copy, a slot mapping of another rank) does not
#: pass, and neither does a step that breaks a rule: :data:`STEP` then decides and words it.
FAST_VALUES: list[Rule | Let] = [
    Let("qsl_t", "batch.query_start_loc_cpu"),
    Let("seq_t", "batch.seq_lens_cpu"),
    Let("slots_t", "batch.slot_mapping_cpu"),
    Let("table_t", "batch.block_table_cpu"),
    Let("slots_t", "slot_mapping if slots_t is None else slots_t"),
    Let("table_t", "block_table if table_t is None else table_t"),
    Rule("slots_t.is_cpu and table_t.is_cpu and slot_mapping.ndim == 1"),
    Rule(
        "qsl_t.is_contiguous() and seq_t.is_contiguous() and slots_t.is_contiguous() "
        "and table_t.is_contiguous()"
    ),
    Let(
        "got",
        "_compiled_step_values(qsl_t.data_ptr(), _ITEMSIZE[qsl_t.dtype], seq_t.data_ptr(), "
        "_ITEMSIZE[seq_t.dtype], B, batch.block_size, batch.num_actual_tokens, "
        "batch.max_query_len, batch.max_seq_len, slots_t.data_ptr(), _ITEMSIZE[slots_t.dtype], "
        "slots_t.shape[0], table_t.data_ptr(), _ITEMSIZE[table_t.dtype], block_table.shape[1])",
    ),
    Rule("got is not None"),
]
#: Every check of a step with the compiled pass: what :data:`STEP` returns where it passes
#: (its arrays read from the batch on first use: :class:`_FastStepFacts`). Only ``passes`` is
#: read (:func:`check_step`): a failure is worded by :data:`STEP`.
FAST_STEP = Rules(
    "batch, spec, device", [*STRUCTURE, *FAST_VALUES], returns="_FastStepFacts.made(batch, got)"
)
#: :data:`FAST_STEP` for a step whose structure the compiled structure pass cleared (its
#: batch then dense): the values alone, over the fields that pass proved.
FAST_VALUES_OF_SOUND_STRUCTURE = Rules(
    "batch, spec, device",
    [
        Let("slot_mapping", "batch.slot_mapping"),
        Let("block_table", "batch.block_table"),
        Let("B", "batch.num_reqs"),
        *FAST_VALUES,
    ],
    returns="_FastStepFacts.made(batch, got)",
)
#: A slot mapping given to ``write_kv`` without a step.
GIVEN_SLOTS = Rules("slots, cache", [SLOT_FACTS, SLOT_IN_CACHE, SLOTS_DISTINCT])
#: A checked step's extents in a cache: O(1) where they fit (the host data is read only to
#: name what does not, or to find that a large block-table entry is one no request reads).
EXTENTS = Rules(
    "extents, batch, cache",
    [
        Rule(
            "extents.max_slot < cache.num_slots",
            otherwise="GIVEN_SLOTS.explain(batch.host_slot_mapping().numpy(), cache)",
        ),
        Rule(
            "extents.max_block < cache.num_blocks",
            otherwise="EXTENT_BLOCKS.explain(batch.seq_lens_cpu.numpy(), batch.block_size, "
            "batch.host_block_table().numpy(), extents.max_block, cache)",
        ),
    ],
)
EXTENT_BLOCKS = Rules("seq, block_size, table, top, cache", [BLOCK_IN_CACHE])


_MAX, _MIN, _OR = np.maximum.reduce, np.minimum.reduce, np.logical_or.reduce
#: Lengths are differences taken in int64 (``_SUB(a, b, dtype=_I64)``): exact for int32 data
_SUB, _I64 = np.subtract, np.int64
#: A signed table read as unsigned: its dtype, and the largest value without a negative entry.
_UNSIGNED = {
    np.dtype(np.int32): (np.uint32, int(np.iinfo(np.int32).max)),
    np.dtype(np.int64): (np.uint64, int(np.iinfo(np.int64).max)),
}


def _slot_facts(slots: np.ndarray) -> tuple[int, int, bool]:
    """(smallest, largest, whether two written entries are equal): one sort gives all three
    (-1, -1 where there is no slot)."""
    if slots.size == 1:
        return int(slots[0]), int(slots[0]), False
    if not slots.size:
        return -1, -1, False
    ordered = slots.copy()
    ordered.sort()
    lo, hi = int(ordered[0]), int(ordered[-1])
    if lo < 0:
        ordered = ordered[int(np.searchsorted(ordered, 0)) :]
    # sorted: distinct where no two neighbours are equal (a difference is never below 0)
    return lo, hi, ordered.size > 1 and int(_MIN(ordered[1:] - ordered[:-1])) == 0


def _block_facts(table: np.ndarray) -> tuple[int, int]:
    """(the largest entry read as unsigned, the largest a table without negative entries
    has): one reduction bounds the table and tells whether an entry is negative."""
    as_unsigned = _UNSIGNED.get(table.dtype)
    if as_unsigned is None:  # (not a table a batch holds: int32 and int64 only)
        table = table.astype(np.int64)
        as_unsigned = _UNSIGNED[table.dtype]
    unsigned, largest = as_unsigned
    # (a 1-D reduction: axis=None costs ~2 us more on tables this small)
    return int(_MAX(table.reshape(-1).view(unsigned))), largest


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~0.35 us more per step
class StepExtents:
    """What a layer compares of a step, in O(1): upper bounds of the cache addresses it uses
    (found once per step on its host copies by :func:`check_step`) and the backend whose
    builder made it; made by ``build`` and only read afterwards. ``check_extents`` compares
    the bounds with a cache; only when one does not fit does it look at the step's host data
    again, to name the entry or to clear a block-table entry no request reads."""

    max_slot: int  # the largest slot written (-1: none, or not read: structural checks)
    max_block: int  # the largest block-table entry, read or not (-1: no request, or not read)
    #: The backend whose builder made the step (layers accept the step only for a backend of
    #: its kind, spec and device: AttentionImpl._check_owner).
    owner: object = field(default=None, repr=False, compare=False)
    #: The slot mapping the engine gave, where ``build`` made a dense copy of a strided one
    #: (``write_kv(slot_mapping=, meta=)`` accepts either).
    given_slot_mapping: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs ~1 us more per step
class StepFacts:
    """What :func:`check_step` read of a step's host copies on the way, for the builder's
    planning hook to reuse instead of reading the batch again (``Step.facts``; read only).
    Where the compiled pass checked the step, the arrays are read from the batch on first use
    (:class:`_FastStepFacts`), the same values."""

    max_slot: int  # the largest slot written (-1: none, or not read: structural checks)
    max_block: int  # the largest block-table entry, read or not (-1: no request, or not read)
    min_slot: int = -1  # the smallest slot_mapping entry (-1: padding, or no token)
    #: Host facts of the step (None where they were not read: structural checks).
    query_lens: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B]
    seq_lens: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B]
    context_lens: np.ndarray | None = field(default=None, repr=False, compare=False)  # [B]
    min_query_len: int = 0
    min_context_len: int = 0
    #: The host copies as numpy, read once (``.numpy()`` costs ~1 us a call): [B + 1] query
    #: start offsets and [B, max_blocks] block table (None where not read).
    query_start_locs: np.ndarray | None = field(default=None, repr=False, compare=False)
    block_table: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, batch: BatchMetadata) -> StepFacts:
        """A batch's lengths read from its host copies (no slot or block read: extents -1),
        for a plan made without the step's checks (a captured graph's)."""
        qsl = batch.query_start_loc_cpu.numpy()
        seq = batch.seq_lens_cpu.numpy()
        q = _diff(qsl)
        ctx = _minus(seq, q)
        return cls(
            max_slot=-1,
            max_block=-1,
            query_lens=q,
            seq_lens=seq,
            context_lens=ctx,
            min_query_len=int(q.min()) if q.size else 0,
            min_context_len=int(ctx.min()) if ctx.size else 0,
            query_start_locs=qsl,
        )


class _ReadOnlyFacts(StepFacts):
    """:class:`StepFacts` no one may change: one instance serves every step."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"StepFacts.{name}: the facts of a checked step are read only")


def _structural_facts() -> StepFacts:
    facts = StepFacts(max_slot=-1, max_block=-1)
    facts.__class__ = _ReadOnlyFacts  # (the same slots: only writes change)
    return facts


#: The facts of every step checked for its structure only (``values=False``): nothing read
#: (extents -1, no arrays); one read-only instance, as they are the same for every step.
STRUCTURAL_FACTS = _structural_facts()


def _lazily(
    name: str, read: Callable[[_FastStepFacts, BatchMetadata], np.ndarray | None]
) -> property:
    """A :class:`StepFacts` array as a property of :class:`_FastStepFacts`: ``read`` from the
    batch on first use, then kept in the field's slot (None for a batch without requests, as
    :data:`STEP` has it)."""
    slot = StepFacts.__dict__[name]  # the dataclass field's slot

    def get(self: _FastStepFacts) -> np.ndarray | None:
        try:
            return slot.__get__(self)
        except AttributeError:  # not read yet
            value = read(self, self._batch) if self._batch.num_reqs else None
            slot.__set__(self, value)
            return value

    def put(self: _FastStepFacts, value: np.ndarray | None) -> None:
        slot.__set__(self, value)

    return property(get, put, doc=f"StepFacts.{name}, read from the batch on first use")


class _FastStepFacts(StepFacts):
    """The :class:`StepFacts` of a step checked by the compiled pass (:data:`FAST_STEP`): its
    scalars from the pass, its arrays read from the batch's host copies on first use, once,
    exactly as :data:`STEP` reads them (a planner that reads them pays what it pays without
    the pass; one that does not, nothing)."""

    __slots__ = ("_batch",)
    _batch: BatchMetadata

    query_start_locs = _lazily("query_start_locs", lambda f, b: b.query_start_loc_cpu.numpy())
    seq_lens = _lazily("seq_lens", lambda f, b: b.seq_lens_cpu.numpy())
    query_lens = _lazily("query_lens", lambda f, b: _diff(f.query_start_locs))
    context_lens = _lazily("context_lens", lambda f, b: _minus(f.seq_lens, f.query_lens))
    block_table = _lazily("block_table", lambda f, b: b.host_block_table().numpy())

    @classmethod
    def made(cls, batch: BatchMetadata, got: tuple[int, int, int, int, int]) -> _FastStepFacts:
        """The facts of ``batch`` from the pass's (max_slot, max_block, min_slot,
        min_query_len, min_context_len): no array read yet."""
        facts = _NEW(cls)
        (
            facts.max_slot,
            facts.max_block,
            facts.min_slot,
            facts.min_query_len,
            facts.min_context_len,
        ) = got
        facts._batch = batch
        return facts


_NEW = object.__new__


def _diff(qsl: np.ndarray | None) -> np.ndarray:
    """A step's query lengths from its query start offsets, in int64 (as :data:`LENGTHS`)."""
    assert qsl is not None
    return _SUB(qsl[1:], qsl[:-1], dtype=_I64)


def _minus(seq: np.ndarray | None, qlens: np.ndarray | None) -> np.ndarray:
    assert seq is not None and qlens is not None
    return seq - qlens


def check_slot_values(slot_mapping: torch.Tensor, cache: PagedKVCache) -> None:
    """Every slot is -1 (padding) or inside the cache, and no two are equal: for ``write_kv``
    given a slot mapping of its own (not a step's). Reads values on the host (numpy: a torch
    reduction costs several times more on tensors this small); a slot mapping on an
    accelerator is copied to the host first, which is why engines write with
    ``write_kv(meta=)`` (checked once per step)."""
    if slot_mapping.numel():
        GIVEN_SLOTS.check(slot_mapping.to("cpu").numpy(), cache)


def check_extents(extents: StepExtents, batch: BatchMetadata, cache: PagedKVCache) -> None:
    """The step's slots and blocks fit ``cache``: two integer comparisons. Only when a bound
    does not fit are the step's host copies read again (never device memory), to name the
    entry, or to find that the large block-table entry is one no request reads."""
    EXTENTS.check(extents, batch, cache)


def check_batch(batch: BatchMetadata) -> None:
    """``BatchMetadata.validate``: the batch's own consistency (its structure and lengths,
    :data:`BATCH`, for its own block size and device), on host copies only."""
    BATCH.check(batch, batch, batch.device)


def check_batch_for_spec(spec: AttentionSpec, batch: BatchMetadata, device: torch.device) -> None:
    """The batch's structure and lengths (:data:`BATCH`), for ``spec`` on ``device``: every
    check of a step but its slots and blocks (:func:`check_step` makes them all)."""
    BATCH.check(batch, spec, device)


def check_step(
    spec: AttentionSpec, batch: BatchMetadata, device: torch.device, *, values: bool = True
) -> StepFacts:
    """Every check of a step (:data:`STEP`: its structure, lengths, slots and blocks), once per
    step, in as few host operations as the usual step allows (a step is paid on every engine
    step: a numpy reduction costs ~1 us, a torch op 3-5 us). Returns its extents and what was
    read on the way (:class:`StepFacts`).

    With ``values=False`` only the structure is checked (shapes, dtypes, devices: O(1), no
    value read): the trade-off an engine that builds each step itself may make, as vLLM's and
    FlashInfer's own builders do. Nothing then bounds the step's slots and blocks (extents -1:
    layers compare nothing), so a wrong value reaches the kernels."""
    if not values:
        return check_structure(spec, batch, device)
    return _full.passes(batch, spec, device) or STEP.explain(batch, spec, device)


def check_structure(spec: AttentionSpec, batch: BatchMetadata, device: torch.device) -> StepFacts:
    """A step's structure only (``check_step(values=False)``): :data:`STRUCTURAL_FACTS`, or
    the error of the first structure rule that does not hold."""
    return STEP_STRUCTURE.passes(batch, spec, device) or STEP_STRUCTURE.explain(batch, spec, device)


def checked_step(
    spec: AttentionSpec, batch: BatchMetadata, device: torch.device
) -> tuple[BatchMetadata, StepFacts]:
    """:func:`check_step` of :func:`dense_batch` of ``batch``: the batch the step's kernels
    read (``batch`` itself where it is dense) and its facts. Where attnhub-speedups' structure
    pass is in use and clears the batch (dense, structure sound), only the values are left to
    check; else the batch is made dense and checked as it is without the pass (check_step's
    body, inlined: a call less on every step)."""
    if _structure is not None and _structure(batch, spec.block_size, device):
        return batch, (
            FAST_VALUES_OF_SOUND_STRUCTURE.passes(batch, spec, device)
            or STEP.explain(batch, spec, device)
        )
    batch = dense_batch(batch)
    return batch, (_full.passes(batch, spec, device) or STEP.explain(batch, spec, device))


def checked_structure(
    spec: AttentionSpec, batch: BatchMetadata, device: torch.device
) -> tuple[BatchMetadata, StepFacts]:
    """:func:`check_structure` of :func:`dense_batch` of ``batch``, as :func:`checked_step`
    (the structure pass, where it is in use, decides the usual batch alone)."""
    if _structure is not None and _structure(batch, spec.block_size, device):
        return batch, STRUCTURAL_FACTS
    batch = dense_batch(batch)
    return batch, (
        STEP_STRUCTURE.passes(batch, spec, device) or STEP_STRUCTURE.explain(batch, spec, device)
    )


#: The table :func:`check_step` passes a step's full checks through: :data:`FAST_STEP` where
#: attnhub-speedups is installed and not turned off (``ATTNHUB_SPEEDUPS=0``,
#: :func:`use_speedups`), else :data:`STEP`. Either way a step that does not pass is decided
#: and worded by :data:`STEP` (``explain`` returns its facts where every rule holds).
_full = STEP
#: attnhub-speedups' structure pass where it is built for this torch and the passes are in
#: use (:func:`use_speedups`), else None: :func:`checked_step` and :func:`checked_structure`
#: then run the Python rules.
_structure: _StepStructure | None = None


def speedups_available() -> bool:
    """Whether attnhub-speedups (the compiled step checks) is installed and importable."""
    return _compiled_step_values is not None


def use_speedups(enabled: bool = True) -> bool:
    """Run a step's full checks through the compiled pass of attnhub-speedups (``enabled``)
    or the pure-Python rules; returns whether the compiled pass is now in use (False where it
    is not installed). Verdicts, errors and facts are the same either way; for benchmarks and
    tests (``ATTNHUB_SPEEDUPS=0`` in the environment turns it off at import)."""
    global _full, _structure
    _full = FAST_STEP if enabled and _compiled_step_values is not None else STEP
    _structure = _compiled_step_structure if _full is FAST_STEP else None
    return _full is FAST_STEP


def speedups_in_use() -> bool:
    """Whether a step's full checks run through the compiled pass now."""
    return _full is FAST_STEP


def structure_pass_in_use() -> bool:
    """Whether a step's structure is checked by attnhub-speedups' compiled structure pass now
    (where it is not built for this torch: :data:`STRUCTURE_PASS_MISSING` says why)."""
    return _structure is not None


use_speedups(os.environ.get("ATTNHUB_SPEEDUPS", "1").strip().lower() not in ("0", "false", "no"))


def check_given_lengths(
    qlens: np.ndarray, seq: np.ndarray, table: np.ndarray, block_size: int
) -> None:
    """``BatchMetadata.from_lengths``'s lengths and table (:data:`GIVEN_LENGTHS`)."""
    if qlens.size:
        GIVEN_LENGTHS.check(qlens, seq, table, block_size)


INT_DTYPES = (torch.int32, torch.int64)


#: A batch's integer tensors that kernels may read, by field name (host copies included:
#: some kernels take lengths from the host).
_DENSE_FIELDS = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "seq_lens_cpu",
    "block_table",
    "block_table_cpu",
    "slot_mapping",
    "slot_mapping_cpu",
)


def dense_batch(batch: BatchMetadata) -> BatchMetadata:
    """``batch`` itself when every integer tensor of it is dense (the usual step: eight
    ``is_contiguous`` calls, no op dispatched); else a copy of it whose strided ones are made
    contiguous (a device copy, no sync). A kernel reads slots, tables and lengths through a raw
    pointer: a strided view, e.g. every other entry of an engine's buffer, would have it read
    the wrong entries (a write to the wrong slots). Anything that is not a batch of tensors is
    returned as it is, for :func:`check_step` to name."""
    try:
        if (
            batch.slot_mapping.is_contiguous()
            and batch.block_table.is_contiguous()
            and batch.query_start_loc.is_contiguous()
            and batch.seq_lens.is_contiguous()
            and batch.query_start_loc_cpu.is_contiguous()
            and batch.seq_lens_cpu.is_contiguous()
            and (batch.block_table_cpu is None or batch.block_table_cpu.is_contiguous())
            and (batch.slot_mapping_cpu is None or batch.slot_mapping_cpu.is_contiguous())
        ):
            return batch
    except AttributeError:  # not a BatchMetadata, or a field that is not a tensor
        return batch
    dense: dict[str, Any] = {}
    for name in _DENSE_FIELDS:
        t = getattr(batch, name)
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            dense[name] = t.contiguous()
    return replace(batch, **dense)


def check_dense(batch: BatchMetadata, why: str) -> None:
    """Every integer tensor of ``batch`` is dense, else InvalidInputError naming it and its
    strides (where a dense copy is not an option: ``why``)."""
    for name in _DENSE_FIELDS:
        t = getattr(batch, name)
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            raise InvalidInputError(
                f"batch.{name} is a strided view (shape {tuple(t.shape)}, strides "
                f"{t.stride()}): {why}, so it must be contiguous"
            )


def check_common_prefix(batch: BatchMetadata, common_prefix_len: object, step: StepFacts) -> None:
    """``common_prefix_len`` is an int in 0..the shortest context, and its whole blocks are
    the same blocks in every request's table: a cascade reads the shared prefix from the first
    request's table for every request, so a table that differs there would have the others
    attend over another request's keys. Host data only (the table as the step's checks read
    it)."""
    if isinstance(common_prefix_len, bool) or not isinstance(common_prefix_len, int):
        raise InvalidInputError(f"common_prefix_len = {common_prefix_len!r} must be an int")
    if common_prefix_len < 0 or (
        batch.num_reqs and common_prefix_len > int(batch.context_lens_cpu.min())
    ):
        raise InvalidInputError(
            f"common_prefix_len = {common_prefix_len} must be in 0..the shortest context"
        )
    blocks = common_prefix_len // batch.block_size
    if not blocks or batch.num_reqs < 2:
        return
    table = step.block_table if step.block_table is not None else batch.host_block_table().numpy()
    shared = table[:, :blocks]
    differs = (shared != shared[:1]).any(axis=1)
    if bool(differs.any()):
        r = int(np.flatnonzero(differs)[0])
        raise InvalidInputError(
            f"common_prefix_len = {common_prefix_len} covers block_table[:, :{blocks}], but "
            f"block_table[{r}, :{blocks}] = {table[r, :blocks].tolist()} differs from "
            f"block_table[0, :{blocks}] = {table[0, :blocks].tolist()}: the requests do not "
            "share that prefix"
        )
