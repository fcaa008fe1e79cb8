"""Bitwise batch invariance: asked for by the spec (``AttentionSpec.batch_invariant``), declared
per dtype (``Capabilities.batch_invariant``), refused with the backend's reason where not; the
torch backend serves it by planning one attention call per request."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import attnhub
from attnhub import AttentionSpec, BatchInvariance, Capabilities, GraphSupport, Refusal
from attnhub.capabilities import BATCH_INVARIANCE_NOT_DECLARED
from attnhub.cli import main
from attnhub.errors import (
    InvalidInputError,
    InvalidSpecError,
    UnknownNameError,
    UnsupportedConfigurationError,
)
from attnhub.graphs import GraphRunner
from attnhub.testing import fill_cache_random, generator, make_batch, random_qkv
from attnhub.torch_backend import TorchBackend

SPEC = AttentionSpec(
    num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, batch_invariant=True
)


def test_the_spec_asks_for_it_with_a_bool() -> None:
    assert AttentionSpec(num_heads=4, num_kv_heads=4, head_size=64).batch_invariant is False
    with pytest.raises(InvalidSpecError, match="batch_invariant = 1 must be a bool"):
        AttentionSpec(num_heads=4, num_kv_heads=4, head_size=64, batch_invariant=1)  # type: ignore[arg-type]


def test_the_declaration_refuses_by_dtype_and_by_cache_format_with_its_reason() -> None:
    declared = BatchInvariance(
        dtypes=frozenset({torch.bfloat16}), kv_cache_dtypes=frozenset({"auto"}), reason="why"
    )
    assert declared.refusal(SPEC) is None
    r = declared.refusal(dataclasses.replace(SPEC, dtype=torch.float16))
    assert isinstance(r, Refusal) and (r.field, r.value) == ("batch_invariant", torch.float16)
    assert "dtype torch.float16" in r and "(why)" in r
    r = declared.refusal(dataclasses.replace(SPEC, kv_cache_dtype="fp8_e4m3"))
    assert r is not None and r.value == "fp8_e4m3" and "kv_cache_dtype 'fp8_e4m3'" in r
    nothing = BatchInvariance().refusal(SPEC)
    assert nothing is not None and BATCH_INVARIANCE_NOT_DECLARED in nothing


def test_a_spec_that_does_not_ask_is_never_refused_for_it() -> None:
    plain = dataclasses.replace(SPEC, batch_invariant=False)
    assert BatchInvariance().refusal(plain) is None
    caps = Capabilities(devices=None, dtypes=frozenset({torch.bfloat16}))
    assert caps.unsupported_reasons(plain) == []
    assert [r.field for r in caps.unsupported_reasons(SPEC)] == ["batch_invariant"]


def test_a_declaration_must_say_why_and_name_real_formats() -> None:
    with pytest.raises(InvalidInputError, match="must say why"):
        BatchInvariance(reason=" ")
    with pytest.raises(UnknownNameError, match="fp9"):
        BatchInvariance(kv_cache_dtypes=frozenset({"fp9"}))


class NotInvariantBackend(TorchBackend):
    name = "torch-not-invariant"
    capabilities = dataclasses.replace(
        TorchBackend.capabilities, batch_invariant=BatchInvariance(reason="the test kernel's")
    )


def test_a_backend_that_does_not_declare_it_refuses_the_spec_with_its_reason() -> None:
    with pytest.raises(UnsupportedConfigurationError) as info:
        NotInvariantBackend(SPEC)
    assert "batch_invariant" in str(info.value) and "the test kernel's" in str(info.value)
    NotInvariantBackend(dataclasses.replace(SPEC, batch_invariant=False))  # served without


def test_the_summary_shows_the_declaration() -> None:
    summary = TorchBackend.capabilities.summary()["batch_invariant"]
    assert isinstance(summary, dict)
    assert summary["dtypes"] == ["bfloat16", "float16", "float32"]
    assert summary["kv_cache_dtypes"] == "any" and "graph" in summary["reason"]
    none = Capabilities(devices=None, dtypes=frozenset({torch.float32})).summary()
    assert none["batch_invariant"] == {
        "dtypes": [],
        "kv_cache_dtypes": "any",
        "reason": BATCH_INVARIANCE_NOT_DECLARED,
    }


def test_attnhub_list_json_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    listed = {b["name"]: b for b in json.loads(capsys.readouterr().out)}
    torch_caps = listed["torch"]["capabilities"]
    assert torch_caps["batch_invariant"]["dtypes"] == ["bfloat16", "float16", "float32"]


def _step(spec: AttentionSpec, lens: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple:
    batch, nblk = make_batch(*lens, spec.block_size, seed=3)
    backend = TorchBackend(spec)
    return backend, batch, nblk


@pytest.mark.parametrize("invariant", [False, True])
def test_the_torch_backend_plans_one_call_per_request_when_asked(invariant: bool) -> None:
    """Decodes are batched into chunks (padded to the longest) by default; a batch-invariant
    spec makes each request a call of its own shapes."""
    spec = dataclasses.replace(SPEC, batch_invariant=invariant)
    lens = ((1, 1, 1, 3, 3, 40), (9, 30, 77, 20, 50, 90))
    backend, batch, _ = _step(spec, lens)
    chunks = backend.metadata_builder().build(batch).plan.chunks
    sizes = [c.num_reqs for c in chunks]
    if invariant:
        assert sizes == [1] * 6
        assert [c.kv_len for c in chunks] == list(lens[1])  # each its own keys, unpadded
    else:
        assert sizes == [3, 2, 1]


def test_a_batch_invariant_request_is_planned_as_when_alone() -> None:
    backend, batch, _ = _step(SPEC, ((1, 1, 1), (9, 77, 30)))
    alone, _ = make_batch((1,), (77,), SPEC.block_size, seed=3)
    builder = backend.metadata_builder()
    among = builder.build(batch).plan.chunks[1]
    (single,) = builder.build(alone).plan.chunks
    assert (among.num_reqs, among.query_len, among.kv_len, among.num_blocks) == (
        single.num_reqs,
        single.query_len,
        single.kv_len,
        single.num_blocks,
    )
    assert among.mask is None and single.mask is None and among.pad_tokens is None


def test_a_batch_invariant_spec_refuses_graph_capture_with_its_reason() -> None:
    backend, batch, _ = _step(SPEC, ((1, 1), (9, 30)))
    with pytest.raises(UnsupportedConfigurationError, match="batch_invariant: graph capture"):
        backend.metadata_builder().build_for_graph_capture(batch)


def test_a_batch_invariant_spec_declares_no_graph_support() -> None:
    """Its captures are refused, so its builder's level says so: a graph runner refuses it at
    construction, and vLLM (through the adapter's level) never plans a FULL graph of it."""
    backend = TorchBackend(SPEC, "cpu")
    assert backend.metadata_builder().graph_support == GraphSupport.NEVER
    plain = TorchBackend(dataclasses.replace(SPEC, batch_invariant=False), "cpu")
    assert plain.metadata_builder().graph_support == GraphSupport.UNIFORM_BATCH
    with pytest.raises(UnsupportedConfigurationError, match=r"GraphSupport\.NEVER"):
        GraphRunner(backend, lambda *a: None, capture_sizes=[2], max_blocks_per_req=4, kv_caches=[])


def test_select_backend_serves_a_batch_invariant_spec_through_torch() -> None:
    backend = attnhub.select_backend(SPEC, "cpu", prefer="torch")
    batch, nblk = make_batch((1, 5), (9, 30), SPEC.block_size, seed=3)
    cache = backend.allocate_kv_cache(nblk)
    fill_cache_random(cache, generator(4))
    q, k, v = random_qkv(SPEC, batch.num_tokens, generator(5))
    out = backend.impl().forward(q, k, v, cache, backend.metadata_builder().build(batch))
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_attnhub_select_asks_for_it_and_names_each_refusal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    attnhub.register_backend(NotInvariantBackend)
    try:
        args = ["select", "--heads", "8", "--kv-heads", "2", "--head-size", "64"]
        assert main([*args, "--batch-invariant"]) == 0
        out = capsys.readouterr().out
        assert "selected: torch" in out and "the test kernel's" in out
        assert main([*args, "--batch-invariant", "--prefer", NotInvariantBackend.name]) != 0
    finally:
        from attnhub import registry

        registry.default_registry().unregister(NotInvariantBackend.name)
