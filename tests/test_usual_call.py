"""The usual layer call is checked in one pass (AttentionImpl._usual_call: every shared check of
forward and write_kv(meta=) in one expression, against the cache the checks accepted last):
it must accept and refuse exactly what the checks run one by one accept and refuse, with
their errors, and leave a refused cache untouched. Over the torch backend; the Ascend
backend's tests hold its own checks to the same (backends/ascend/tests/test_ascend_host_path.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnhub import AttentionSpec, PagedKVCache
from attnhub.errors import InvalidInputError
from attnhub.testing import (
    bad_layer_calls,
    call_outcome,
    checked_in_full,
    fill_cache_random,
    generator,
    make_batch,
    random_qkv,
)
from attnhub.torch_backend import TorchAttentionImpl, TorchBackend

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, block_size=16)
Call = dict[str, Any]


def _warm() -> tuple[TorchBackend, TorchAttentionImpl, Call]:
    backend = TorchBackend(SPEC)
    g = generator(3)
    batch, num_blocks = make_batch([1, 5, 1], [20, 9, 33], 16, seed=g, num_tokens=9)
    cache = backend.allocate_kv_cache(num_blocks + 1)
    fill_cache_random(cache, g)
    q, k, v = random_qkv(SPEC, batch.num_tokens, g)
    meta = backend.metadata_builder().build(batch)
    impl = backend.impl()
    impl.forward(q, k, v, cache, meta)  # accepted in full: remembered
    return backend, impl, dict(query=q, key=k, value=v, cache=cache, meta=meta, output=None)


WRONG = list(bad_layer_calls(*_warm()[::2]))


def test_the_usual_call_takes_the_one_pass_path() -> None:
    """Else the comparisons below would compare the checks with themselves."""
    _, impl, c = _warm()
    assert impl._usual_call(**c)
    assert impl._usual_call(**{**c, "key": None, "value": None})
    assert impl._usual_call(**{**c, "output": torch.empty_like(c["query"])})
    assert impl._usual_step(c["cache"], c["meta"])
    assert impl._usual_kv(c["key"], c["value"], c["meta"])


@pytest.mark.parametrize("case", [*WRONG, "good", "no new keys"])
def test_forward_checks_accept_and_refuse_exactly_as_the_full_checks(case: str) -> None:
    backend, impl, c = _warm()
    calls = {
        **bad_layer_calls(backend, c),
        "good": c,
        "no new keys": {**c, "key": None, "value": None},
    }
    call = calls[case]
    full = call_outcome(lambda: checked_in_full(impl, lambda: impl.check_forward(**call)))
    fast = call_outcome(lambda: impl.check_forward(**call))
    assert fast == full
    if case not in ("good", "no new keys"):
        assert full[0] != "ok", f"{case}: the full checks accepted it, the case tests nothing"


@pytest.mark.parametrize(
    "case", [c for c in WRONG if not c.startswith(("query", "output"))] + ["good", "own slots"]
)
def test_write_kv_meta_checks_accept_and_refuse_exactly_as_the_full_checks(case: str) -> None:
    backend, impl, c = _warm()
    call = {**bad_layer_calls(backend, c), "good": c, "own slots": c}[case]
    args = (call["key"], call["value"], call["cache"])
    slots = (
        call["meta"].batch.slot_mapping
        if case == "own slots" and hasattr(call["meta"], "batch")
        else None
    )
    cache = call["cache"]
    before = cache.clone() if isinstance(cache, PagedKVCache) else None
    full = call_outcome(
        lambda: checked_in_full(impl, lambda: impl.write_kv(*args, slots, meta=call["meta"]))
    )
    fast = call_outcome(lambda: impl.write_kv(*args, slots, meta=call["meta"]))
    assert fast == full
    if case not in ("good", "own slots"):
        assert full[0] != "ok", f"{case}: the full checks accepted it, the case tests nothing"
        if before is not None:
            assert cache.equal(before)  # a refused write changed nothing


def test_another_slot_tensor_than_the_steps_is_refused() -> None:
    _, impl, c = _warm()
    other = c["meta"].batch.slot_mapping.clone()
    with pytest.raises(InvalidInputError, match=r"slot_mapping is not meta\.batch"):
        impl.write_kv(c["key"], c["value"], c["cache"], other, meta=c["meta"])


def test_a_cache_whose_plane_was_replaced_is_checked_again() -> None:
    _, impl, c = _warm()
    cache = c["cache"]
    cache.key = cache.key.to(torch.float16)  # the same cache object, another plane
    assert not impl._usual_call(**c)
    with pytest.raises(InvalidInputError, match="cache stores"):
        impl.forward(c["query"], c["key"], c["value"], cache, c["meta"])


def test_another_cache_goes_through_the_full_checks_once() -> None:
    backend, impl, c = _warm()
    other = backend.allocate_kv_cache(40)  # another layer's cache, the same geometry
    assert not impl._usual_call(**{**c, "cache": other})
    impl.forward(c["query"], c["key"], c["value"], other, c["meta"])  # accepted in full
    assert impl._usual_call(**{**c, "cache": other}) and not impl._usual_call(**c)
