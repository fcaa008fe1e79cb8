"""attnhub inside ``torch.compile``: a layer call as one ``torch.library`` custom op.

A compiled model calls :func:`attention` where an eager one calls ``impl.forward``::

    attnhub.register_layer("layers.0.attn", impl, cache)   # once, when the model is built
    ...
    with attnhub.forward_context(meta):                     # once per step, outside the graph
        y = compiled_model(x)         # each layer: attnhub.attention(q, k, v, cache, its name)

``attention`` calls the op ``torch.ops.attnhub.forward`` (:data:`attention_op`). Dynamo does not
trace into it: the graph holds one opaque call per layer whose inputs are tensors and the
layer's name, and whose fake (meta) implementation says what it writes. So nothing of a step's
metadata (lengths, block tables, the backend's plan) reaches the graph and nothing is
specialized on it: a graph compiled once, with the token dimension dynamic
(``torch._dynamo.mark_dynamic(x, 0)``), runs every later step, whatever its lengths, batch size
or kinds of requests.

How the metadata crosses the op's boundary (the design choice, as vLLM's
``unified_attention_with_output`` makes it): a custom op takes tensors and scalars, not a
backend's metadata object, so the op takes the layer's name and finds

- the layer's impl and cache (their structure: layout, block size, scales, packing) in a
  per-process registry filled once (:func:`register_layer`, vLLM's static forward context),
- the step's metadata in a forward context set outside the compiled region
  (:func:`forward_context`, vLLM's ``set_forward_context``): one ``build`` per step, read by
  every layer's op call.

Passing the metadata as tensors instead would put its host copies (lengths, the plan) on the
graph's boundary, where every backend's host-side planning would have to be redone inside the
op each layer (or be traced, and specialized on).

What the op writes is declared (``mutates_args``): the output buffer, the cache's planes (keys,
values and, for a per-slot-scaled cache, its scale planes) and the LSE buffer where asked for.
So functionalization neither drops the write (an op that returns nothing and declares no
mutation is dead code to the compiler) nor, under inductor (``torch.compile``'s default
backend), copies the cache: inductor hands the op the cache's own planes. The op writes into the
planes it is given; a compiler that functionalizes without re-inplacing (``backend=
"aot_eager"``) hands it copies, which it copies back after the call: correct, at the cost of a
full copy of the cache per layer and step, which the op warns of once per layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, overload

import torch

from attnhub.backend import AttentionImpl, AttentionMetadata
from attnhub.errors import InvalidInputError
from attnhub.kv_cache import PagedKVCache

#: The op's qualified name: ``torch.ops.attnhub.forward``.
OP_NAME = "attnhub::forward"


@dataclass(frozen=True)
class _Layer:
    impl: AttentionImpl
    cache: PagedKVCache


_LAYERS: dict[str, _Layer] = {}
_LAYERS_LOCK = threading.Lock()
_WARNED_COPY: set[str] = set()
#: The step's metadata: one for every layer, or one per layer name.
_STEP: contextvars.ContextVar[AttentionMetadata | Mapping[str, AttentionMetadata] | None] = (
    contextvars.ContextVar("attnhub_step", default=None)
)


def register_layer(
    name: str, impl: AttentionImpl, cache: PagedKVCache, *, replace: bool = False
) -> str:
    """Bind the layer ``name`` to its impl and KV cache, for :func:`attention` (once, when the
    model is built: vLLM's static forward context). Returns ``name``.

    A name already bound to another impl or cache is refused (two layers of one model given
    the same name would write each other's cache) unless ``replace=True`` (a model rebuilt)."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"a layer name must be a non-empty string, got {name!r}")
    if not isinstance(impl, AttentionImpl):
        raise InvalidInputError(f"impl must be an AttentionImpl, got {type(impl).__name__}")
    if not isinstance(cache, PagedKVCache):
        raise InvalidInputError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    with _LAYERS_LOCK:
        old = _LAYERS.get(name)
        if old is not None and not replace and (old.impl is not impl or old.cache is not cache):
            raise InvalidInputError(
                f"layer name {name!r} is already registered with another impl or cache "
                "(give every layer its own name, or pass replace=True)"
            )
        _LAYERS[name] = _Layer(impl, cache)
        _WARNED_COPY.discard(name)
    return name


def unregister_layer(name: str) -> None:
    """Forget the layer ``name`` (its impl and cache are no longer kept alive by attnhub)."""
    with _LAYERS_LOCK:
        if _LAYERS.pop(name, None) is None:
            raise InvalidInputError(f"layer name {name!r} is not registered")
        _WARNED_COPY.discard(name)


@contextlib.contextmanager
def forward_context(
    meta: AttentionMetadata | Mapping[str, AttentionMetadata],
) -> Iterator[None]:
    """The step whose layers run inside the block: ``meta`` (what ``metadata_builder().build``
    returned, once per step) for every layer, or a mapping from layer name to metadata where
    layers of different specs have builders of their own. Set it outside the compiled region
    (vLLM's ``set_forward_context``): the graph never sees it. Per thread and per asyncio task
    (a context variable); nests, restoring the outer step on exit."""
    if not isinstance(meta, AttentionMetadata | Mapping):
        raise InvalidInputError(
            "forward_context takes a step's metadata (metadata_builder().build(batch)) or a "
            f"mapping from layer name to metadata, got {type(meta).__name__}"
        )
    token = _STEP.set(meta)
    try:
        yield
    finally:
        _STEP.reset(token)


def _step_of(name: str) -> AttentionMetadata:
    step = _STEP.get()
    if step is None:
        raise InvalidInputError(
            f"attnhub.attention(layer {name!r}) ran outside attnhub.forward_context(meta): set "
            "the step's metadata around the model call"
        )
    if isinstance(step, AttentionMetadata):
        return step
    meta = step.get(name)
    if meta is None:
        raise InvalidInputError(
            f"the forward context's metadata mapping has no entry for layer {name!r} "
            f"(it has {sorted(step)[:8]})"
        )
    return meta


def _layer(name: str) -> _Layer:
    layer = _LAYERS.get(name)
    if layer is None:
        raise InvalidInputError(
            f"layer name {name!r} is not registered: call attnhub.register_layer(name, impl, "
            "cache) when the model is built"
        )
    return layer


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def mutable_planes(cache: PagedKVCache) -> list[torch.Tensor]:
    """The tensors of ``cache`` a layer call writes: keys and values, and the scale planes of a
    per-slot-scaled format (``PagedKVCache.planes()``), in that order: what :func:`attention`
    passes as the op's ``kv_cache``."""
    return list(cache.planes().values())


def _cache_given(name: str, registered: PagedKVCache, planes: list[torch.Tensor]) -> PagedKVCache:
    """The cache the op writes: the registered one where ``planes`` are its memory, else the
    registered structure over the planes given (a compiler's copies), with a warning."""
    own = mutable_planes(registered)
    if len(planes) != len(own):
        raise InvalidInputError(
            f"layer {name!r}: the op was given {len(planes)} cache planes, its registered "
            f"cache has {len(own)} (pass the layer's registered cache to attnhub.attention)"
        )
    if all(_same_memory(p, o) for p, o in zip(planes, own, strict=True)):
        return registered
    for p, o in zip(planes, own, strict=True):
        if p.shape != o.shape or p.dtype != o.dtype or p.device != o.device:
            raise InvalidInputError(
                f"layer {name!r}: a cache plane given is {p.dtype} {list(p.shape)} on "
                f"{p.device}, the registered cache's is {o.dtype} {list(o.shape)} on {o.device}"
            )
    if name not in _WARNED_COPY:
        _WARNED_COPY.add(name)
        warnings.warn(
            f"layer {name!r}: attnhub's op was given other memory than the registered KV cache "
            "(a compiler that copies mutated inputs, e.g. torch.compile(backend='aot_eager'), "
            "or another cache than the one registered): it writes there; a copy is a full "
            "copy of the cache per call (inductor passes the cache itself)",
            RuntimeWarning,
            stacklevel=2,
        )
    fields: dict[str, object] = dict(zip(registered.planes(), planes, strict=True))
    return dataclasses.replace(registered, **fields)  # type: ignore[arg-type]


#: The op plans nothing itself but reads a step's metadata on the host per call: a CUDA graph
#: that ``torch.compile`` captures (``mode="reduce-overhead"``) would replay one step's plan for
#: every later step. Tagged so that inductor keeps it out of the graphs it captures (torch 2.8+:
#: the tag exists); attnhub's own graph runner (``attnhub.graphs``) captures attention instead.
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


# ``lse`` is mutable and may be None, but has no default: torch's custom_op wrapper (2.11 and
# earlier, pytorch/pytorch#176078, fixed by #180621) bumps the version of each mutated argument
# by its schema position, and the dispatcher strips an argument left at its default first, so
# every call without an LSE raised IndexError('tuple index out of range'): eager and compiled
# (seen on torch 2.11, 2026-11-26).
@torch.library.custom_op(OP_NAME, mutates_args=("output", "kv_cache", "lse"), tags=_TAGS)
def attention_op(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor,
    kv_cache: list[torch.Tensor],
    layer_name: str,
    lse: torch.Tensor | None,  # no default (above)
) -> None:
    """``torch.ops.attnhub.forward``: the registered layer ``layer_name``'s ``impl.forward``
    with the forward context's metadata, writing ``output`` (and ``lse`` where given) and the
    cache planes ``kv_cache`` (:func:`mutable_planes`). Call it through :func:`attention`."""
    layer = _layer(layer_name)
    meta = _step_of(layer_name)
    cache = _cache_given(layer_name, layer.cache, kv_cache)
    if lse is None:
        layer.impl.forward(query, key, value, cache, meta, output=output)
    else:
        layer.impl.forward(query, key, value, cache, meta, output=output, return_lse=True, lse=lse)


@attention_op.register_fake
def _attention_fake(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    output: torch.Tensor,
    kv_cache: list[torch.Tensor],
    layer_name: str,
    lse: torch.Tensor | None,
) -> None:
    """Nothing to compute at trace time: the op returns nothing, and what it writes (output,
    the cache, lse) is declared by ``mutates_args``, in place and of the shapes given."""
    return None


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    cache: PagedKVCache,
    layer_name: str,
    *,
    output: torch.Tensor | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    cache: PagedKVCache,
    layer_name: str,
    *,
    output: torch.Tensor | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size]; None: nothing new
    value: torch.Tensor | None,
    cache: PagedKVCache,
    layer_name: str,
    *,
    output: torch.Tensor | None = None,  # [num_tokens, num_heads, head_size_v]
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``impl.forward`` as a ``torch.compile``-able call: the impl and cache
    registered as ``layer_name`` (:func:`register_layer`; ``cache`` must be that cache: the
    op declares that it writes its planes), the metadata of the enclosing
    :func:`forward_context`. Returns the output (``output`` where given, else a new tensor like
    ``query``, as wide as the cache's values: ``head_size_v``), and with ``return_lse=True``
    ``(out, lse)``, ``lse`` ``[num_tokens, num_heads]`` float32 as ``forward(return_lse=True)``
    gives it. Every check of ``forward``
    runs when the op runs; eager calls work the same. Inference only: no gradient flows
    through the op, and inputs that require grad (grad mode on) are refused."""
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value)
    ):
        raise InvalidInputError(
            f"attnhub.attention (layer {layer_name!r}) computes no gradients, and query, key or "
            "value requires grad: run the model under torch.no_grad() or torch.inference_mode()"
        )
    if output is not None:
        out = output
    elif cache.head_size_v == query.shape[2]:
        out = torch.empty_like(query)
    else:  # values of another head size than keys (head_size_v): the output is as wide
        out = query.new_empty((query.shape[0], query.shape[1], cache.head_size_v))
    lse = None
    if return_lse:
        lse = torch.empty(
            (query.shape[0], query.shape[1]), dtype=torch.float32, device=query.device
        )
    torch.ops.attnhub.forward(query, key, value, out, mutable_planes(cache), layer_name, lse)
    if lse is not None:
        return out, lse
    return out
