"""Refusals are values (field, value, supported set, sentence), printed as sentences."""

from __future__ import annotations

import dataclasses
import pickle

import torch

from attnhub import AttentionSpec, Refusal
from attnhub.torch_backend import TorchBackend

SPEC = AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16)


def caps(**changes: object):  # type: ignore[no-untyped-def]
    return dataclasses.replace(TorchBackend.capabilities, **changes)  # type: ignore[arg-type]


def test_a_refusal_is_its_sentence_and_says_what_was_refused() -> None:
    (r,) = caps(dtypes=frozenset({torch.bfloat16})).unsupported_reasons(SPEC)
    assert isinstance(r, Refusal) and isinstance(r, str)
    assert r == "dtype torch.float16 is not supported (supported: bfloat16)"
    assert (r.field, r.value, r.supported) == ("dtype", torch.float16, frozenset({torch.bfloat16}))


def test_every_capability_refusal_names_its_field() -> None:
    spec = dataclasses.replace(
        SPEC,
        head_size=48,
        head_size_v=None,  # values as wide as the keys (replace keeps the old 64 otherwise)
        block_size=24,
        kv_cache_dtype="fp8_e4m3",
        logits_soft_cap=30.0,
    )
    narrow = caps(
        head_sizes=frozenset({64}),
        max_head_size=32,
        head_size_multiple=32,
        block_size_multiple=16,
        kv_cache_dtypes=frozenset({"auto"}),
        softcap=False,
    )
    fields = [r.field for r in narrow.unsupported_reasons(spec)]
    head = ["head_size"] * 3  # not in the set, over the maximum, not a multiple
    assert fields == [*head, "block_size", "kv_cache_dtype", "softcap"]


def test_because_appends_a_backends_reason_and_keeps_the_data() -> None:
    (r,) = caps(softcap=False).unsupported_reasons(dataclasses.replace(SPEC, logits_soft_cap=5.0))
    explained = r.because("the kernel has no tanh")
    assert explained == "feature 'softcap' is not supported (the kernel has no tanh)"
    assert (explained.field, explained.value) == ("softcap", True)


def test_a_refusal_pickles_whole() -> None:
    (r,) = caps(dtypes=frozenset({torch.bfloat16})).unsupported_reasons(SPEC)
    back = pickle.loads(pickle.dumps(r))
    assert back == r and back.field == "dtype" and back.supported == r.supported
