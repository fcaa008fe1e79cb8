"""The catalogue of invalid inputs: each must raise its typed ``attnhub.errors`` exception and
leave the KV cache byte-identical (every check runs before anything is written).

An entry provokes one mistake on an otherwise valid step (see ``harness.prepare``): a wrong
dtype, shape or device of q/k/v, a slot or block outside the cache, an impossible batch, a cache
or metadata that does not belong to this backend, or a spec the backend does not support.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch

from attnhub import AttentionMetadata, BatchMetadata, PagedKVCache, testing
from attnhub.errors import (
    AttnhubError,
    InvalidInputError,
    InvalidSpecError,
    UnsupportedConfigurationError,
)
from attnhub.spec import KV_CACHE_DTYPES, MODEL_DTYPES, AttentionType
from attnhub_conformance.cases import Config
from attnhub_conformance.harness import Layer, Step, with_tensors
from attnhub_conformance.targets import Target


@dataclass(frozen=True)
class InvalidInput:
    name: str
    proves: str
    error: type[AttnhubError]
    provoke: Callable[[Step, Layer], object]
    #: Why the entry does not apply to a backend/config (None: it applies).
    not_applicable: Callable[[Target, Config], str | None] = lambda target, config: None


def wrong_device(step: Step) -> str:
    return "meta" if step.device.type != "meta" else "cpu"


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else torch.float16


def _forward(
    step: Step,
    layer: Layer,
    *,
    batch: BatchMetadata | None = None,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    cache: PagedKVCache | None = None,
    meta: object = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Build (from ``batch`` if given) and forward, with the inputs given replaced (``meta`` may
    be something that is not a builder's metadata: that is the wrong input then)."""
    built = step.build(batch) if meta is None else cast(AttentionMetadata, meta)
    new_kv = step.plan.new_kv
    args = (
        layer.query if query is None else query,
        key if key is not None else (layer.key if new_kv else None),
        value if value is not None else (layer.value if new_kv else None),
        layer.cache if cache is None else cache,
        built,
    )
    if output is None:
        return layer.impl.forward(*args)
    return layer.impl.forward(*args, output=output)


def _with_slot(step: Step, slot: int) -> BatchMetadata:
    """The batch with its last real token's slot replaced (earlier tokens stay valid, so a
    backend that writes before checking corrupts the cache)."""
    slots = step.batch.slot_mapping.clone()
    slots[step.n - 1] = slot
    return with_tensors(step.batch, slot_mapping=slots)


def _with_block(step: Step, block: int) -> BatchMetadata:
    """The batch with one block-table entry replaced: a block of cached context only (so the
    slot mapping stays valid) where there is one."""
    bs = step.spec.block_size
    table = step.batch.block_table.clone()
    r, c = 0, 0
    for i, (q, s) in enumerate(step.plan.requests):
        if s - q >= bs:
            r = i
            break
    table[r, c] = block
    return with_tensors(step.batch, block_table=table)


def _with_lengths(
    step: Step, *, query_start_loc: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None
) -> BatchMetadata:
    b = step.batch
    qsl = b.query_start_loc_cpu if query_start_loc is None else query_start_loc
    seq = b.seq_lens_cpu if seq_lens is None else seq_lens
    return replace(
        b,
        query_start_loc=qsl.to(b.device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(b.device),
        seq_lens_cpu=seq,
    )


def _query_len_zero(step: Step, layer: Layer) -> object:
    qsl = step.batch.query_start_loc_cpu.clone()
    qsl[1] = qsl[0]  # request 0 gets no tokens
    return _forward(step, layer, batch=_with_lengths(step, query_start_loc=qsl))


def _seq_below_query(step: Step, layer: Layer) -> object:
    q = step.batch.query_lens_cpu
    r = int(torch.argmax(q))
    seq = step.batch.seq_lens_cpu.clone()
    seq[r] = q[r] - 1
    return _forward(step, layer, batch=_with_lengths(step, seq_lens=seq))


def _other_cache(step: Step, **changes: object) -> PagedKVCache:
    spec = replace(step.spec, **changes)  # type: ignore[arg-type]
    return PagedKVCache.for_spec(
        spec, step.num_blocks, step.device, layout=step.backend.capabilities.kv_cache_layout
    )


def _cache_of_other_format(step: Step, layer: Layer) -> object:
    current = step.spec.kv_cache_dtype
    other = "auto" if current != "auto" else "fp8_e4m3"
    if current == "auto" and step.spec.dtype == torch.float32:
        cache = _other_cache(step, dtype=torch.float16)  # same format name, other storage dtype
    else:
        cache = _other_cache(step, kv_cache_dtype=other)
    return _forward(step, layer, cache=cache)


def _unsupported_spec(target: Target, config: Config) -> Config | None:
    """The base config with one thing the backend does not declare (None: it declares all)."""
    caps = target.capabilities
    candidates = [config.with_(dtype=d) for d in MODEL_DTYPES if d not in caps.dtypes]
    candidates += [
        config.with_(kv_cache_dtype=k) for k in KV_CACHE_DTYPES if k not in caps.kv_cache_dtypes
    ]
    candidates += [config.with_(attn_type=t) for t in AttentionType if t not in caps.attn_types]
    candidates += [config.with_(head_size=h) for h in (72, 160, 320, 1024)]
    candidates += [config.with_(block_size=b) for b in (24, 48, 2048)]
    for c in candidates:
        try:
            if caps.unsupported_reasons(c.spec()):
                return c
        except InvalidSpecError:
            continue
    return None


def _construct_unsupported(step: Step, layer: Layer) -> object:
    config = _unsupported_spec(step.target, step.config)
    assert config is not None
    return step.target.create(config.spec())


def _alibi_undeclared(step: Step, layer: Layer) -> object:
    return step.backend.impl(alibi_slopes=torch.ones(step.spec.num_heads))


def _prefix_too_long(step: Step, layer: Layer) -> object:
    shortest = int(step.batch.context_lens_cpu.min())
    return step.builder.build(step.batch, common_prefix_len=shortest + 1)


def _write_kv_bad_slot(step: Step, layer: Layer) -> object:
    slots = step.batch.slot_mapping[: step.n].clone()
    slots[-1] = layer.cache.num_slots
    layer.impl.write_kv(layer.key, layer.value, layer.cache, slots)
    return None


def _write_kv_value_width(width: str) -> Callable[[Step, Layer], object]:
    """write_kv alone (its own slots, and with the step's metadata) with a value of the
    ``width`` ("key": head_size, "wider": head_size_v + 8) in place of head_size_v."""

    def provoke(step: Step, layer: Layer) -> object:
        spec = step.spec
        size = spec.head_size if width == "key" else spec.head_size_v + 8
        value = _resized(layer.value, 2, size)
        slots = step.batch.slot_mapping[: step.n]
        try:
            layer.impl.write_kv(layer.key, value, layer.cache, slots)
        except InvalidInputError:
            pass
        else:
            raise AssertionError(f"write_kv accepted a value {size} wide")
        layer.impl.write_kv(layer.key, value, layer.cache, meta=step.build())
        return None

    return provoke


def _write_kv_step_bad_slot(step: Step, layer: Layer) -> object:
    meta = step.builder.build(_with_slot(step, layer.cache.num_slots))
    layer.impl.write_kv(layer.key, layer.value, layer.cache, meta=meta)
    return None


def _write_kv_step_other_slots(step: Step, layer: Layer) -> object:
    slots = step.batch.slot_mapping.clone()  # same values, another tensor: still refused
    layer.impl.write_kv(layer.key, layer.value, layer.cache, slots, meta=step.build())
    return None


def _other_spec_config(target: Target, config: Config, field_name: str) -> Config | None:
    """The config with ``field_name`` (block_size or head_size) changed to a value the
    backend serves, or None."""
    current = getattr(config, field_name)
    if field_name == "block_size":
        candidates = [current * 2, current * 4]
    else:
        candidates = [h for h in (64, 128, 256, 80, 96, 32, 192, 512) if h != current]
    for value in candidates:
        other = config.with_(**{field_name: value})
        try:
            if not target.capabilities.unsupported_reasons(other.spec()):
                return other
        except InvalidSpecError:
            continue
    return None


def _meta_of_other_spec(field_name: str) -> Callable[[Step, Layer], object]:
    def provoke(step: Step, layer: Layer) -> object:
        other = _other_spec_config(step.target, step.config, field_name)
        assert other is not None
        backend = step.target.create(other.spec())
        batch = step.batch
        if field_name == "block_size":  # the same table read with larger blocks: still valid
            batch = replace(batch, block_size=other.block_size)
        meta = backend.metadata_builder().build(batch)
        if step.plan.new_kv:  # the write alone first: it must be refused too
            try:
                layer.impl.write_kv(layer.key, layer.value, layer.cache, meta=meta)
            except InvalidInputError:
                pass
            else:
                raise AssertionError("write_kv(meta=) accepted metadata of another spec")
        return _forward(step, layer, meta=meta)

    return provoke


def _no_other(field_name: str) -> Callable[[Target, Config], str | None]:
    def why(target: Target, config: Config) -> str | None:
        if _other_spec_config(target, config, field_name) is None:
            return f"the backend serves no other {field_name} for this config"
        return None

    return why


def _common_prefix_not_shared(step: Step, layer: Layer) -> object:
    """Two requests whose first blocks differ, with common_prefix_len = one block."""
    bs = step.spec.block_size
    nb = step.num_blocks
    assert nb >= 4, f"the step's cache has {nb} blocks"
    batch = BatchMetadata.from_lengths(
        [1, 1], [bs + 1, bs + 1], [[nb - 1, nb - 2], [nb - 3, nb - 4]], bs, device=step.device
    )
    return step.builder.build(batch, common_prefix_len=bs)


def _swap_to_tensors(step: Step, layer: Layer) -> object:
    c = layer.cache
    c.swap_blocks((c.key, c.value), [[0, 0]])  # type: ignore[arg-type]
    return None


def _needs_new_kv(target: Target, config: Config) -> str | None:
    if config.attn_type is AttentionType.ENCODER_DECODER:
        return "cross-attention steps write no new keys"
    return None


def _same_head_sizes(target: Target, config: Config) -> str | None:
    """Not applicable where values are as wide as keys (nothing to confuse), or no new keys."""
    if config.head_size_v in (None, config.head_size):
        return "the spec's values are as wide as its keys"
    return _needs_new_kv(target, config)


def _output(step: Step, layer: Layer, width: int | None = None, **kw: Any) -> torch.Tensor:
    """An output buffer [num_tokens, num_heads, width] (default: ``head_size_v``, the good
    width), like the query otherwise."""
    spec = step.spec
    shape = (layer.query.shape[0], spec.num_heads, spec.head_size_v if width is None else width)
    return torch.empty(shape, dtype=kw.get("dtype", layer.query.dtype), device=step.device)


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


def _e(
    name: str,
    proves: str,
    provoke: Callable[[Step, Layer], object],
    error: type[AttnhubError] = InvalidInputError,
    not_applicable: Callable[[Target, Config], str | None] | None = None,
) -> InvalidInput:
    return InvalidInput(name, proves, error, provoke, not_applicable or (lambda t, c: None))


INVALID_INPUTS: tuple[InvalidInput, ...] = (
    _e(
        "query_dtype",
        "a query in another dtype than the spec's",
        lambda s, la: _forward(s, la, query=la.query.to(other_dtype(s.spec.dtype))),
    ),
    _e(
        "key_dtype",
        "a key in another dtype than the spec's",
        lambda s, la: _forward(s, la, key=la.key.to(other_dtype(s.spec.dtype))),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "value_dtype",
        "a value in another dtype than the spec's",
        lambda s, la: _forward(s, la, value=la.value.to(other_dtype(s.spec.dtype))),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "query_num_heads",
        "a query with num_heads + 1 heads",
        lambda s, la: _forward(s, la, query=_resized(la.query, 1, s.spec.num_heads + 1)),
    ),
    _e(
        "key_num_kv_heads",
        "a key with num_kv_heads + 1 heads",
        lambda s, la: _forward(s, la, key=_resized(la.key, 1, s.spec.num_kv_heads + 1)),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "value_head_size",
        "a value with another head size",
        lambda s, la: _forward(s, la, value=_resized(la.value, 2, s.spec.head_size_v + 8)),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "value_as_wide_as_key",
        "a value head_size wide where the spec's values are head_size_v (a kernel that reads "
        "values at the key's width)",
        lambda s, la: _forward(s, la, value=_resized(la.value, 2, s.spec.head_size)),
        not_applicable=_same_head_sizes,
    ),
    _e(
        "output_as_wide_as_query",
        "an output buffer of the query's shape where the output is head_size_v wide",
        lambda s, la: _forward(s, la, output=_output(s, la, s.spec.head_size)),
        not_applicable=_same_head_sizes,
    ),
    _e(
        "query_rank",
        "a 2-D query [num_tokens, num_heads * head_size]",
        lambda s, la: _forward(s, la, query=la.query.reshape(la.query.shape[0], -1)),
    ),
    _e(
        "query_too_few_tokens",
        "fewer query rows than the batch has tokens",
        lambda s, la: _forward(s, la, query=la.query[: s.n - 1]),
    ),
    _e(
        "key_too_few_tokens",
        "fewer key/value rows than slot_mapping entries",
        lambda s, la: _forward(s, la, key=la.key[: s.n - 1], value=la.value[: s.n - 1]),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "query_last_dim_strided",
        "a query whose last dimension is strided (stride 2): refused before any write, never "
        "handed to a kernel that reads each head's vector densely",
        lambda s, la: _forward(s, la, query=testing.strided_last_dim(la.query)),
    ),
    _e(
        "key_last_dim_strided",
        "a key whose last dimension is strided (stride 2)",
        lambda s, la: _forward(s, la, key=testing.strided_last_dim(la.key)),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "value_last_dim_strided",
        "a value whose last dimension is strided (stride 2)",
        lambda s, la: _forward(s, la, value=testing.strided_last_dim(la.value)),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "output_last_dim_strided",
        "an output buffer whose last dimension is strided (stride 2)",
        lambda s, la: _forward(s, la, output=testing.strided_last_dim(_output(s, la))),
    ),
    _e(
        "query_device",
        "a query on another device",
        lambda s, la: _forward(s, la, query=la.query.to(wrong_device(s))),
    ),
    _e(
        "value_device",
        "a value on another device",
        lambda s, la: _forward(s, la, value=la.value.to(wrong_device(s))),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "output_dtype",
        "an output buffer in another dtype",
        lambda s, la: _forward(s, la, output=_output(s, la, dtype=torch.float64)),
    ),
    _e(
        "cache_block_size",
        "a cache allocated for another block size",
        lambda s, la: _forward(s, la, cache=_other_cache(s, block_size=s.spec.block_size * 2)),
    ),
    _e("cache_format", "a cache of another storage format", _cache_of_other_format),
    _e(
        "slot_outside_cache",
        "slot_mapping entry = num_slots (one past the cache)",
        lambda s, la: _forward(s, la, batch=_with_slot(s, la.cache.num_slots)),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "slot_repeated",
        "two tokens of the step with the same slot (an engine's overlapping blocks)",
        lambda s, la: _forward(s, la, batch=_with_slot(s, int(s.batch.slot_mapping[0]))),
        not_applicable=_needs_new_kv,  # the main shapes carry several new tokens
    ),
    _e(
        "slot_negative",
        "slot_mapping entry = -2 (only -1 means padding)",
        lambda s, la: _forward(s, la, batch=_with_slot(s, -2)),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "write_kv_slot_outside_cache",
        "write_kv with a slot one past the cache",
        _write_kv_bad_slot,
        not_applicable=_needs_new_kv,
    ),
    _e(
        "write_kv_step_slot_outside_cache",
        "write_kv(meta=) of a step whose slot_mapping has an entry one past the cache",
        _write_kv_step_bad_slot,
        not_applicable=_needs_new_kv,
    ),
    _e(
        "write_kv_value_head_size",
        "write_kv (own slots and with meta=) with a value of another head size than head_size_v",
        _write_kv_value_width("wider"),
        not_applicable=_needs_new_kv,
    ),
    _e(
        "write_kv_value_as_wide_as_key",
        "write_kv (own slots and with meta=) with a value head_size wide where the spec's "
        "values are head_size_v",
        _write_kv_value_width("key"),
        not_applicable=_same_head_sizes,
    ),
    _e(
        "write_kv_step_other_slot_mapping",
        "write_kv(meta=) with a slot_mapping that is not the step's own",
        _write_kv_step_other_slots,
        not_applicable=_needs_new_kv,
    ),
    _e(
        "block_table_outside_cache",
        "a block table entry = num_blocks",
        lambda s, la: _forward(s, la, batch=_with_block(s, s.num_blocks)),
    ),
    _e(
        "block_table_negative",
        "a block table entry = -1",
        lambda s, la: _forward(s, la, batch=_with_block(s, -1)),
    ),
    _e(
        "query_start_loc_device_short",
        "a device query_start_loc one entry short of num_reqs + 1 (its host copy right): a "
        "kernel reading num_reqs + 1 offsets from it would read past its end",
        lambda s, la: _forward(
            s, la, batch=replace(s.batch, query_start_loc=s.batch.query_start_loc[:-1])
        ),
    ),
    _e(
        "seq_lens_device_short",
        "a device seq_lens one entry short of num_reqs (its host copy right)",
        lambda s, la: _forward(s, la, batch=replace(s.batch, seq_lens=s.batch.seq_lens[:-1])),
    ),
    _e("query_len_zero", "a request with query_len 0", _query_len_zero),
    _e("seq_len_below_query_len", "a request with seq_len < query_len", _seq_below_query),
    _e(
        "batch_block_size",
        "a batch built for another block size",
        lambda s, la: _forward(s, la, batch=replace(s.batch, block_size=s.spec.block_size * 2)),
    ),
    _e(
        "meta_not_built",
        "forward given a BatchMetadata instead of the builder's metadata",
        lambda s, la: _forward(s, la, meta=s.batch),
    ),
    _e(
        "alibi_slopes_undeclared",
        "ALiBi slopes given to a layer whose spec has no ALiBi",
        _alibi_undeclared,
        not_applicable=lambda t, c: "the spec uses ALiBi" if "alibi" in c.features else None,
    ),
    _e(
        "common_prefix_too_long",
        "common_prefix_len longer than the shortest context",
        _prefix_too_long,
        not_applicable=lambda t, c: None if t.capabilities.cascade else "cascade not declared",
    ),
    _e(
        "meta_other_block_size",
        "forward and write_kv(meta=) given metadata built for another block size",
        _meta_of_other_spec("block_size"),
        not_applicable=_no_other("block_size"),
    ),
    _e(
        "meta_other_head_size",
        "forward and write_kv(meta=) given metadata built for another head size",
        _meta_of_other_spec("head_size"),
        not_applicable=_no_other("head_size"),
    ),
    _e(
        "common_prefix_not_shared",
        "common_prefix_len of one block while the requests' first blocks differ",
        _common_prefix_not_shared,
        not_applicable=lambda t, c: None if t.capabilities.cascade else "cascade not declared",
    ),
    _e(
        "copy_blocks_none",
        "cache.copy_blocks(None)",
        lambda s, la: la.cache.copy_blocks(None),  # type: ignore[arg-type]
    ),
    _e(
        "copy_blocks_not_pairs",
        "cache.copy_blocks with rows of one block id",
        lambda s, la: la.cache.copy_blocks([[0, 1], [2]]),
    ),
    _e(
        "swap_blocks_not_a_cache",
        "cache.swap_blocks to a (key, value) tuple instead of a PagedKVCache",
        _swap_to_tensors,
    ),
    _e(
        "swap_blocks_none_mapping",
        "cache.swap_blocks with block_mapping None",
        lambda s, la: la.cache.swap_blocks(la.cache.empty_like(), None),  # type: ignore[arg-type]
    ),
    _e(
        "unsupported_spec",
        "a spec the capabilities refuse, at construction",
        _construct_unsupported,
        error=UnsupportedConfigurationError,
        not_applicable=lambda t, c: (
            None
            if _unsupported_spec(t, c)
            else "the backend declares every capability the suite can name"
        ),
    ),
)

CATALOGUE = {entry.name: entry for entry in INVALID_INPUTS}
