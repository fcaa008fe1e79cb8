"""attnhub under torch.compile (attnhub.torch_compile): the layer call is one custom op, so a
model compiles once and runs every step; what the op writes is declared, so the cache is written
in place and the write is kept."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.decorators import mark_unbacked
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import attnhub
from attnhub import testing
from attnhub.errors import InvalidInputError, UnsupportedConfigurationError
from attnhub.torch_compile import OP_NAME, mutable_planes

HIDDEN = 32
BLOCK = 16
NUM_BLOCKS = 48
#: Steps of new lengths and batch sizes (query lens, seq lens): decodes, prefills, chunked
#: prefills, multi-token decodes; every step has at least two tokens (see the one-token test).
STEPS = [
    ([3, 5], [3, 5]),
    ([1, 1, 4], [4, 6, 4]),
    ([2, 7], [5, 12]),
    ([1, 1, 1, 1, 1], [7, 7, 13, 2, 9]),
    ([9], [40]),
    ([1, 3, 1], [50, 3, 17]),
    ([20, 1, 1, 1], [20, 33, 2, 64]),
    ([1, 1], [90, 3]),
    ([5, 5, 5], [5, 21, 8]),
]


class DecoderLayer(torch.nn.Module):
    """Projections, attnhub attention (through the op), output projection."""

    def __init__(self, spec: attnhub.AttentionSpec, cache: attnhub.PagedKVCache, name: str):
        super().__init__()
        g = testing.generator(7)
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_size
        self.wq = torch.randn(h * d, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        self.wk = torch.randn(hkv * d, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        self.wv = torch.randn(hkv * d, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        self.wo = torch.randn(HIDDEN, h * d, generator=g) / math.sqrt(h * d)
        self.shape = (h, hkv, d)
        self.cache, self.name = cache, name

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, hkv, d = self.shape
        q = (x @ self.wq.t()).view(-1, h, d)
        k = (x @ self.wk.t()).view(-1, hkv, d)
        v = (x @ self.wv.t()).view(-1, hkv, d)
        out = attnhub.attention(q, k, v, self.cache, self.name)
        return out.reshape(-1, h * d) @ self.wo.t(), k, v


def _spec(**kw: object) -> attnhub.AttentionSpec:
    args = dict(num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, block_size=BLOCK)
    args.update(kw)
    return attnhub.AttentionSpec(**args)  # type: ignore[arg-type]


class Model:
    """A backend, its builder, and one decoder layer registered as ``name`` (eager and compiled
    twins over caches of equal contents)."""

    def __init__(self, name: str, spec: attnhub.AttentionSpec | None = None) -> None:
        self.spec = spec or _spec()
        self.backend = attnhub.select_backend(self.spec, "cpu", prefer="torch")
        self.builder = self.backend.metadata_builder()
        self.cache = self.backend.allocate_kv_cache(NUM_BLOCKS)
        testing.fill_cache_random(self.cache, testing.generator(1))
        self.impl = self.backend.impl()
        attnhub.register_layer(name, self.impl, self.cache, replace=True)
        self.layer = DecoderLayer(self.spec, self.cache, name)
        self.gen = testing.generator(3)

    def step(
        self, query_lens: list[int], seq_lens: list[int]
    ) -> tuple[attnhub.BatchMetadata, torch.Tensor]:
        table = testing.shuffled_block_table(seq_lens, BLOCK, NUM_BLOCKS, self.gen)
        batch = attnhub.BatchMetadata.from_lengths(query_lens, seq_lens, table, BLOCK, "cpu")
        return batch, torch.randn(sum(query_lens), HIDDEN, generator=self.gen)


@pytest.fixture
def layer_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        attnhub.unregister_layer(name)
    torch._dynamo.reset()


def _model(layer_names: list[str], name: str, spec: attnhub.AttentionSpec | None = None) -> Model:
    layer_names.append(name)
    return Model(name, spec)


def test_a_compiled_decoder_layer_compiles_once_and_matches_eager_over_nine_steps(layer_names):
    compiled, eager = _model(layer_names, "c.layer"), _model(layer_names, "e.layer")
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    fn = torch.compile(compiled.layer, fullgraph=True, backend=counter)
    with torch.no_grad():
        for query_lens, seq_lens in STEPS:
            batch, x = compiled.step(query_lens, seq_lens)
            torch._dynamo.mark_dynamic(x, 0)  # the token dimension, as an engine marks it
            with attnhub.forward_context(compiled.builder.build(batch)):
                y, _, _ = fn(x)
            with attnhub.forward_context(eager.builder.build(batch)):
                want, _, _ = eager.layer(x)
            torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1  # one compilation, every later step a cache hit
    assert compiled.cache.equal(eager.cache)


def test_one_token_steps_share_the_graph_when_the_token_dimension_is_unbacked(layer_names):
    model = _model(layer_names, "unbacked.layer")
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    fn = torch.compile(model.layer, fullgraph=True, backend=counter)
    with torch.inference_mode():  # as engines run (the other tests: no_grad)
        for query_lens, seq_lens in [([3, 5], [3, 5]), ([1], [30]), ([1, 1], [9, 40]), ([1], [2])]:
            batch, x = model.step(query_lens, seq_lens)
            mark_unbacked(x, 0)  # no 0/1 specialization: a one-token step needs no new graph
            with attnhub.forward_context(model.builder.build(batch)):
                fn(x)
    assert counter.frame_count == 1


def test_a_compiled_step_writes_the_cache_in_place_and_keeps_the_write(layer_names):
    """The op is handed the cache's own planes (it warns where it is handed other memory), the
    generated code copies nothing (no clone of a plane in, no copy back out), and the cache
    holds the keys and values each compiled step wrote."""
    model = _model(layer_names, "inplace.layer")
    fn = torch.compile(model.layer, fullgraph=True)
    ptrs = [p.data_ptr() for p in mutable_planes(model.cache)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for i, (query_lens, seq_lens) in enumerate(STEPS[:3]):
            batch, x = model.step(query_lens, seq_lens)
            torch._dynamo.mark_dynamic(x, 0)
            before = model.cache.clone()
            with attnhub.forward_context(model.builder.build(batch)):
                if i == 0:
                    (_, k, v), code = run_and_get_code(fn, x)
                    text = "\n".join(code)
                    assert "torch.ops.attnhub.forward" in text
                    assert "copy" not in text and "clone" not in text, text
                else:
                    _, k, v = fn(x)
            expected = testing.cache_after_write(before, k, v, batch.slot_mapping)
            assert not testing.cache_differences(model.cache, expected, batch.slot_mapping)
    assert [p.data_ptr() for p in mutable_planes(model.cache)] == ptrs


def test_a_compiler_that_copies_the_cache_still_keeps_the_write_and_says_so(layer_names):
    """aot_eager functionalizes without re-inplacing: the op is handed copies of the planes,
    writes them, and the graph copies them back; the op warns once of the cost."""
    model = _model(layer_names, "copied.layer")
    fn = torch.compile(model.layer, fullgraph=True, backend="aot_eager")
    batch, x = model.step([2, 7], [5, 12])
    before = model.cache.clone()
    meta = model.builder.build(batch)
    warns = pytest.warns(RuntimeWarning, match="given other memory than the registered KV")
    with torch.no_grad(), attnhub.forward_context(meta), warns:
        _, k, v = fn(x)
    expected = testing.cache_after_write(before, k, v, batch.slot_mapping)
    assert not testing.cache_differences(model.cache, expected, batch.slot_mapping)


def test_return_lse_under_compile_is_forward_s(layer_names):
    model = _model(layer_names, "lse.layer")
    cache, name = model.cache, "lse.layer"

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return attnhub.attention(q, k, v, cache, name, return_lse=True)

    fn = torch.compile(attend, fullgraph=True)
    g = testing.generator(5)
    batch, _ = model.step([3, 1, 6], [3, 20, 30])
    meta = model.builder.build(batch)
    q, k, v = testing.random_qkv(model.spec, batch.num_tokens, g)
    twin = cache.clone()
    with attnhub.forward_context(meta):
        out, lse = fn(q, k, v)
    want, want_lse = model.backend.impl().forward(q, k, v, twin, meta, return_lse=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert lse.shape == (batch.num_tokens, model.spec.num_heads) and lse.dtype == torch.float32


def test_the_op_passes_torch_library_opcheck(layer_names):
    """Schema (what it writes is declared), fake implementation, and dispatch under
    functionalization and dynamic shapes, as torch.library.opcheck checks them."""
    model = _model(layer_names, "opcheck.layer")
    batch, _ = model.step([3, 1], [3, 20])
    q, k, v = testing.random_qkv(model.spec, batch.num_tokens, testing.generator(2))
    args = (q, k, v, torch.empty_like(q), mutable_planes(model.cache), "opcheck.layer", None)
    with attnhub.forward_context(model.builder.build(batch)), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # opcheck hands the op copies
        torch.library.opcheck(torch.ops.attnhub.forward.default, args)
    assert OP_NAME == "attnhub::forward"


def test_no_argument_the_op_writes_has_a_default():
    """Regression (torch 2.11 on an H100 machine, 2026-11-26): ``lse`` was ``Tensor(a!)? =
    None``. torch's custom_op wrapper up to 2.11 (pytorch/pytorch#176078) bumps each mutated
    argument's version by its schema position after the dispatcher has stripped arguments left
    at their defaults: every call without an LSE, eager or compiled, raised IndexError."""
    schema = torch.ops.attnhub.forward.default._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert {a.name for a in written} == {"output", "kv_cache", "lse"}
    assert [a.name for a in written if a.has_default_value()] == []


def test_the_op_is_kept_out_of_the_cuda_graphs_torch_compile_captures():
    """It reads each step's metadata on the host: a graph captured around it would replay one
    step's plan (mode="reduce-overhead" splits the graph at an op so tagged)."""
    assert torch.Tag.cudagraph_unsafe in torch.ops.attnhub.forward.default.tags


def test_layers_of_different_specs_take_their_own_metadata_from_a_mapping(layer_names):
    a = _model(layer_names, "map.a")
    b = _model(layer_names, "map.b", _spec(sliding_window=8))
    batch, _ = a.step([4, 1], [4, 30])
    metas = {"map.a": a.builder.build(batch), "map.b": b.builder.build(batch)}
    g = testing.generator(4)
    for model, name in ((a, "map.a"), (b, "map.b")):
        q, k, v = testing.random_qkv(model.spec, batch.num_tokens, g)
        twin = model.cache.clone()
        with attnhub.forward_context(metas):
            out = attnhub.attention(q, k, v, model.cache, name)
        want = model.backend.impl().forward(q, k, v, twin, metas[name])
        assert torch.equal(out, want)


def test_a_call_outside_a_forward_context_is_refused_before_any_write(layer_names):
    model = _model(layer_names, "outside.layer")
    q, k, v = testing.random_qkv(model.spec, 4, testing.generator(0))
    before = model.cache.clone()
    with pytest.raises(InvalidInputError, match=r"outside attnhub\.forward_context"):
        attnhub.attention(q, k, v, model.cache, "outside.layer")
    assert model.cache.equal(before)


def test_an_unregistered_or_unmapped_layer_is_refused(layer_names):
    model = _model(layer_names, "known.layer")
    batch, _ = model.step([4], [4])
    meta = model.builder.build(batch)
    q, k, v = testing.random_qkv(model.spec, 4, testing.generator(0))
    with attnhub.forward_context(meta), pytest.raises(InvalidInputError, match="not registered"):
        attnhub.attention(q, k, v, model.cache, "unknown.layer")
    with (
        attnhub.forward_context({"other": meta}),
        pytest.raises(InvalidInputError, match="no entry"),
    ):
        attnhub.attention(q, k, v, model.cache, "known.layer")
    not_a_step = object()
    with pytest.raises(InvalidInputError, match="forward_context takes"):
        attnhub.forward_context(not_a_step).__enter__()  # type: ignore[arg-type]


def test_a_layer_name_is_bound_once_unless_replaced(layer_names):
    model = _model(layer_names, "bound.layer")
    other = model.backend.impl()
    with pytest.raises(InvalidInputError, match="already registered"):
        attnhub.register_layer("bound.layer", other, model.cache)
    attnhub.register_layer("bound.layer", model.impl, model.cache)  # the same binding: fine
    attnhub.register_layer("bound.layer", other, model.cache, replace=True)
    with pytest.raises(InvalidInputError, match="not registered"):
        attnhub.unregister_layer("never.registered")


def test_a_refusal_inside_the_op_is_the_forward_s_typed_error(layer_names):
    model = _model(layer_names, "refuse.layer", _spec(dtype=torch.bfloat16))
    batch, _ = model.step([4], [4])
    q, k, v = testing.random_qkv(_spec(), 4, testing.generator(0))  # float32: the wrong dtype
    before = model.cache.clone()
    refused = pytest.raises((InvalidInputError, UnsupportedConfigurationError), match="dtype")
    with attnhub.forward_context(model.builder.build(batch)), refused:
        attnhub.attention(q, k, v, model.cache, "refuse.layer")
    assert model.cache.equal(before)


def test_inputs_that_require_grad_are_refused_not_silently_cut_off(layer_names):
    """No gradient flows through the op: a model whose projections need gradients is told so,
    instead of training without the attention's."""
    model = _model(layer_names, "grad.layer")
    batch, x = model.step([3, 5], [3, 5])
    model.layer.wq.requires_grad_(True)
    before = model.cache.clone()
    refused = pytest.raises(InvalidInputError, match="computes no gradients")
    with attnhub.forward_context(model.builder.build(batch)), refused:
        model.layer(x)
    assert model.cache.equal(before)


def test_a_step_with_no_new_keys_passes_none_through_the_op(layer_names):
    """key=value=None (nothing new to write: the cache already holds every key) reaches
    forward as None: the cache untouched, the answer forward's."""
    model = _model(layer_names, "nokv.layer")
    batch, _ = model.step([1, 1], [20, 9])
    meta = model.builder.build(batch)
    q, _, _ = testing.random_qkv(model.spec, batch.num_tokens, testing.generator(6))
    before = model.cache.clone()
    with attnhub.forward_context(meta):
        out = attnhub.attention(q, None, None, model.cache, "nokv.layer")
    assert model.cache.equal(before)
    assert torch.equal(out, model.backend.impl().forward(q, None, None, before, meta))


def test_values_narrower_than_keys_get_an_output_of_the_value_head_size(layer_names):
    """A layer whose values have another head size than its keys (``head_size_v``: MLA's
    expanded prefill) is served through the op, eager and compiled: the output it allocates is
    [T, H, head_size_v], as forward's (it was made like the query, and forward refused it)."""
    model = _model(layer_names, "narrow.layer", _spec(head_size=16, head_size_v=8))
    cache, name = model.cache, "narrow.layer"

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return attnhub.attention(q, k, v, cache, name, return_lse=True)

    compiled = torch.compile(attend, fullgraph=True)
    batch, _ = model.step([3, 1, 6], [3, 20, 30])
    meta = model.builder.build(batch)
    q, k, v = testing.random_qkv(model.spec, batch.num_tokens, testing.generator(8))
    twin = cache.clone()
    want, want_lse = model.backend.impl().forward(q, k, v, twin, meta, return_lse=True)
    for fn in (attend, compiled):  # the second call rewrites what the first wrote
        with attnhub.forward_context(meta):
            out, lse = fn(q, k, v)
        assert out.shape == (batch.num_tokens, 4, 8)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
        assert cache.equal(twin)
