"""MLA layers through the backend protocol (attnhub.mla_backend, Capabilities.mla): selection
from the declaration, the same builder and step checks, the absorbed form's forward against the
reference, and every bad call refused before the latent cache is touched."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import attnhub
from attnhub import AccuracyBound, MlaSupport, reference, testing, validation
from attnhub.capabilities import Refusal
from attnhub.cli import main, mla_line
from attnhub.errors import (
    InvalidInputError,
    UnknownNameError,
    UnsupportedConfigurationError,
)
from attnhub.kv_cache import same_bytes
from attnhub.mla import LatentKVCache, MLASpec
from attnhub.mla_backend import MLAImpl
from attnhub.registry import default_registry
from attnhub.spec import AttentionSpec
from attnhub.torch_backend import TorchBackend

FP8_FORMATS = frozenset({"auto", "fp8_e4m3"})


def mla_spec(**kw: object) -> MLASpec:
    args: dict = dict(
        num_heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32
    )
    args.update(kw)
    return MLASpec(**args)


class StandardOnlyOverride(TorchBackend):
    """A backend whose ``unsupported_reasons`` override reads standard fields only."""

    name = "mla-test-standard-override"
    capabilities = replace(TorchBackend.capabilities, mla=MlaSupport(reason="no kernel for it"))

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec) -> list[Refusal]:
        reasons = super().unsupported_reasons(spec)
        if spec.num_kv_heads > 64:  # an AttributeError on an MLASpec, were it passed here
            reasons.append(Refusal("too many kv heads", field="num_kv_heads"))
        return reasons


class DecodeOnly(TorchBackend):
    name = "mla-test-decode-only"
    capabilities = replace(
        TorchBackend.capabilities,
        mla=replace(TorchBackend.capabilities.mla, max_query_len=1, layouts=("joint",)),
    )


# --- declaration and selection -----------------------------------------------------------------
def test_an_override_written_for_attention_specs_never_sees_an_mla_spec() -> None:
    reasons = StandardOnlyOverride.unsupported_reasons(mla_spec())
    assert [r.field for r in reasons] == ["mla"]
    assert "no kernel for it" in reasons[0]
    assert (
        StandardOnlyOverride.unsupported_reasons(
            AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        )
        == []
    )


def test_a_backend_declaring_no_mla_refuses_it_as_not_wired_yet_at_construction() -> None:
    class Plain(TorchBackend):
        name = "mla-test-plain"
        capabilities = replace(TorchBackend.capabilities, mla=MlaSupport())

    with pytest.raises(UnsupportedConfigurationError, match="not wired yet"):
        Plain(mla_spec())


def test_mla_refusals_name_the_field_value_and_the_backends_reason() -> None:
    support = MlaSupport(
        dtypes=frozenset({torch.float32}),
        block_sizes=frozenset({16}),
        latent_sizes=frozenset({(512, 64)}),
        because={"mla.block_size": "built for 16"},
    )
    reasons = support.unsupported_reasons(mla_spec(block_size=8, kv_cache_dtype="fp8"))
    by_field = {r.field: r for r in reasons}
    assert set(by_field) == {"mla.dtype", "mla.kv_cache_dtype", "mla.block_size", "mla.latent_size"}
    assert by_field["mla.block_size"].sentence.endswith("(built for 16)")
    assert by_field["mla.latent_size"].value == (64, 16)


def test_a_declared_set_of_head_counts_refuses_the_others() -> None:
    support = MlaSupport(
        dtypes=frozenset({torch.float32}),
        num_heads=frozenset({32, 64}),
        because={"mla.num_heads": "the kernel tiles 32 heads"},
    )
    assert support.unsupported_reasons(mla_spec(num_heads=64, dtype=torch.float32)) == []
    (refusal,) = support.unsupported_reasons(mla_spec(num_heads=8, dtype=torch.float32))
    assert refusal.field == "mla.num_heads" and refusal.value == 8
    assert refusal.sentence.endswith("(the kernel tiles 32 heads)")
    assert support.summary()["num_heads"] == [32, 64]
    assert MlaSupport(dtypes=frozenset({torch.float32})).summary()["num_heads"] == "any"


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"kv_cache_dtypes": frozenset({"int8"})}, UnknownNameError),
        ({"layouts": ("NHD",)}, UnknownNameError),
        ({"layouts": ()}, UnknownNameError),
        ({"max_query_len": 0}, InvalidInputError),
        ({"reason": " "}, InvalidInputError),
        # quantization declarations: a declared fp8 format, a known scheme, a bound with it
        ({"query_quantization": {"fp8_e4m3": "fp8_static"}}, UnknownNameError),
        (
            {
                "kv_cache_dtypes": FP8_FORMATS,
                "query_quantization": {"auto": "fp8_static"},
                "quantization_accuracy": {"auto": AccuracyBound(0.1, 0.99)},
            },
            UnknownNameError,
        ),
        (
            {"kv_cache_dtypes": FP8_FORMATS, "query_quantization": {"fp8_e4m3": "fp8"}},
            UnknownNameError,
        ),
        (
            {
                "kv_cache_dtypes": FP8_FORMATS,
                "probability_quantization": {"fp8_e4m3": "fp8_e4m3_unscaled"},
            },
            UnknownNameError,
        ),
        (
            {"kv_cache_dtypes": FP8_FORMATS, "quantization_accuracy": {"fp8_e4m3": (0.1, 0.99)}},
            InvalidInputError,
        ),
    ],
)
def test_an_mla_declaration_that_cannot_hold_is_refused(kw: dict, error: type) -> None:
    with pytest.raises(error):
        MlaSupport(dtypes=frozenset({torch.float32}), **kw)


def test_mla_quantization_declarations_show_in_the_summary_and_the_listing() -> None:
    support = MlaSupport(
        dtypes=frozenset({torch.bfloat16}),
        kv_cache_dtypes=FP8_FORMATS,
        query_quantization={"fp8_e4m3": "fp8_static"},
        probability_quantization={"fp8_e4m3": "fp8_e4m3_unscaled"},
        quantization_accuracy={"fp8_e4m3": AccuracyBound(0.05, 0.999)},
    )
    summary = support.summary()
    assert summary["query_quantization"] == {"fp8_e4m3": "fp8_static"}
    assert summary["probability_quantization"] == {"fp8_e4m3": "fp8_e4m3_unscaled"}
    assert summary["quantization_accuracy"] == {
        "fp8_e4m3": {"max_abs_error": 0.05, "min_cosine": 0.999}
    }
    caps = replace(TorchBackend.capabilities, mla=support)
    assert mla_line(caps).endswith("; fp8_e4m3: query fp8_static, probabilities fp8_e4m3_unscaled")


def test_select_backend_takes_an_mla_spec_and_names_every_refusal() -> None:
    assert attnhub.select_backend(mla_spec(), prefer="torch").is_mla
    attnhub.register_backend(StandardOnlyOverride)
    try:
        with pytest.raises(UnsupportedConfigurationError, match="no kernel for it"):
            attnhub.select_backend(mla_spec(), prefer=StandardOnlyOverride.name)
        ranked = dict(default_registry().rank(mla_spec(), "cpu"))
        assert ranked[StandardOnlyOverride] == ["MLA is not served: no kernel for it"]
    finally:
        default_registry().unregister(StandardOnlyOverride.name)
    summary = TorchBackend.capabilities.summary()["mla"]
    assert summary["served"] and summary["layouts"] == ["joint", "split"]


def test_allocate_gives_a_latent_cache_in_the_first_declared_layout() -> None:
    cache = TorchBackend(mla_spec()).allocate_kv_cache(3)
    assert isinstance(cache, LatentKVCache) and cache.layout == "joint"
    assert cache.num_blocks == 3 and cache.kv_lora_rank == 64


def test_an_mla_layer_takes_no_alibi_slopes_or_sinks() -> None:
    with pytest.raises(InvalidInputError, match="no alibi_slopes or sinks"):
        TorchBackend(mla_spec()).impl(sinks=torch.zeros(4))


# --- the absorbed form through torch -------------------------------------------------------------
def _step(spec: MLASpec, q_lens: list[int], seq_lens: list[int], layout: str = "joint"):
    batch, nb = testing.make_batch(
        q_lens, seq_lens, spec.block_size, seed=2, num_tokens=sum(q_lens) + 2
    )
    cache = LatentKVCache.for_spec(spec, nb + 2, layout=layout)
    g = testing.generator(5)
    testing.fill_latent_cache_random(cache, g)
    kv_c, k_pe = testing.random_latent_kv(spec, batch.num_tokens, g)
    q = testing.random_mla_query(spec, batch.num_tokens, g)
    return batch, cache, q, kv_c, k_pe


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_torch_forward_is_the_reference_absorbed_form_with_its_lse(layout: str, kv: str) -> None:
    spec = mla_spec(dtype=torch.float32, block_size=8, kv_cache_dtype=kv)
    backend = TorchBackend(spec)
    # decode, chunked prefill with context, prefill, multi-token decode; two padding rows
    batch, cache, q, kv_c, k_pe = _step(spec, [1, 6, 4, 2], [13, 21, 4, 9], layout)
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
    meta = backend.metadata_builder().build(batch)
    out = torch.full((q.shape[0], 4, 64), float("nan"))
    got, lse = backend.impl().forward(q, kv_c, k_pe, cache, meta, output=out, return_lse=True)
    assert got is out and cache.equal(want_cache)
    want, want_lse = reference.paged_mla_absorbed(q, cache, batch, spec)
    n = batch.num_actual_tokens
    tol = TorchBackend.capabilities.tolerance(torch.float32)
    assert testing.mismatch(out[:n], want, tol) is None
    assert testing.mismatch(lse[:n], want_lse.t(), tol) is None
    assert bool((out[n:] == 0).all()) and bool(torch.isposinf(lse[n:]).all())


@pytest.mark.parametrize("call", ["forward", "write_kv"])
@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf")], ids=repr)
def test_a_zero_or_non_finite_fp8_latent_scale_is_refused_before_any_write(
    bad: float, call: str
) -> None:
    # Regression: it was written with (x / 0 saturates, 0 / 0 is NaN) and read back as
    # fp8 * scale: every latent 0 or NaN, silently. Checked again after an in-place change.
    spec = mla_spec(dtype=torch.bfloat16, block_size=8, kv_cache_dtype="fp8_e4m3")
    backend = TorchBackend(spec)
    batch, cache, q, kv_c, k_pe = _step(spec, [1, 3], [9, 12])
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    impl.forward(q, kv_c, k_pe, cache, meta)
    assert cache.scale is not None
    cache.scale.fill_(bad)
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=rf"cache\.scale = {bad} must be finite and non-"):
        if call == "forward":
            impl.forward(q, kv_c, k_pe, cache, meta)
        else:
            impl.write_kv(kv_c, k_pe, cache, meta=meta)
    assert cache.equal(before)


def test_an_mla_impl_serving_two_layers_reads_each_latent_scale_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Regression: the impl remembered the last cache's scale only, so one impl called with two
    # layers' caches in turn read the scale on the host at every call (a sync per layer)
    spec = mla_spec(dtype=torch.bfloat16, block_size=8, kv_cache_dtype="fp8_e4m3")
    backend = TorchBackend(spec)
    batch, cache, q, kv_c, k_pe = _step(spec, [1, 3], [9, 12])
    _, other, _, _, _ = _step(spec, [1, 3], [9, 12])
    impl, meta = backend.impl(), backend.metadata_builder().build(batch)
    impl.forward(q, kv_c, k_pe, cache, meta)  # each cache's first sight: its scale read
    impl.forward(q, kv_c, k_pe, other, meta)
    reads: list[object] = []
    monkeypatch.setattr(validation, "check_tensor_scale_values", lambda *a: reads.append(a))
    for layer_cache in (cache, other, cache, other):
        impl.forward(q, kv_c, k_pe, layer_cache, meta)
    assert reads == []


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_torch_reads_fp8_latents_as_vllm_triton_mla_does(layout: str, kv: str) -> None:
    """fp8 latents read back as vLLM's TRITON_MLA decode kernel reads them: ``(fp8 in float32 *
    k_scale).to(model dtype)`` for kv_c and k_pe (triton_decode_attention.py), not the exact
    ``fp8 * scale``. The float32 LSE shows the difference: the exact read is ~1e-3 off."""
    spec = mla_spec(dtype=torch.bfloat16, block_size=8, kv_cache_dtype=kv)
    backend = TorchBackend(spec)
    batch, cache, q, _, _ = _step(spec, [1, 1, 1, 2], [13, 40, 7, 21], layout)
    meta = backend.metadata_builder().build(batch)
    _, lse = backend.impl().forward(q, None, None, cache, meta, return_lse=True)
    assert cache.scale is not None and float(cache.scale) != 1.0

    scale = cache.scale

    def vllm_read(plane: torch.Tensor) -> torch.Tensor:  # the kernel's dequantization
        return (plane.to(torch.float32) * scale).to(torch.bfloat16).double()

    def exact_read(plane: torch.Tensor) -> torch.Tensor:
        return plane.double() * scale.double()

    worst = {}
    for name, read in (("vllm", vllm_read), ("exact", exact_read)):
        kv_c_plane, k_pe_plane = read(cache.kv_c), read(cache.k_pe)
        errors = []
        for r in range(batch.num_reqs):
            lo, hi = int(batch.query_start_loc_cpu[r]), int(batch.query_start_loc_cpu[r + 1])
            pos = torch.arange(int(batch.seq_lens_cpu[r]))
            blocks, offsets = batch.block_table[r].long()[pos // 8], pos % 8
            kv_c, k_pe = kv_c_plane[blocks, offsets], k_pe_plane[blocks, offsets]
            _, want = reference.mla_absorbed(q[lo:hi], kv_c, k_pe, scale=spec.scale)
            errors.append(float((lse[lo:hi].double() - want.t()).abs().max()))
        worst[name] = max(errors)
    tight = 1e-5  # float32 scores and sums over <= 40 keys
    assert worst["vllm"] < tight, worst
    assert worst["exact"] > 10 * tight, f"the test cannot tell the two reads apart: {worst}"


def test_torch_chunks_decodes_and_tiles_long_queries_within_its_budgets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import attnhub.torch_backend.mla as torch_mla

    monkeypatch.setattr(torch_mla, "KEY_BUDGET", 64)
    monkeypatch.setattr(torch_mla, "SCORE_BUDGET", 4096)
    spec = mla_spec(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, block_size=4)
    backend = TorchBackend(spec)
    # decodes of lengths 3, 9, 11 | 30 (two chunks: 4 x 30 keys > 64); a 40-token chunked
    # prefill over 60 keys in tiles of 17 rows (4096 // (4 heads x 60)); a 17-token prefill
    batch, cache, q, kv_c, k_pe = _step(spec, [1, 40, 3, 1, 17, 2], [9, 60, 3, 30, 17, 11])
    meta = backend.metadata_builder().build(batch)
    assert len(meta.mla.chunks) == 6
    out, lse = backend.impl().forward(q, kv_c, k_pe, cache, meta, return_lse=True)
    want, want_lse = reference.paged_mla_absorbed(q, cache, batch, spec)
    n, tol = batch.num_actual_tokens, TorchBackend.capabilities.tolerance(spec.dtype)
    assert testing.mismatch(out[:n], want, tol) is None
    assert testing.mismatch(lse[:n], want_lse.t(), tol) is None


def test_write_kv_alone_writes_what_the_reference_does() -> None:
    spec = mla_spec(block_size=4)
    backend = TorchBackend(spec)
    batch, cache, _, kv_c, k_pe = _step(spec, [3, 1], [5, 2])
    want = cache.clone()
    reference.write_latent_kv(want, kv_c, k_pe, batch.slot_mapping)
    backend.impl().write_kv(kv_c, k_pe, cache, meta=backend.metadata_builder().build(batch))
    assert cache.equal(want)
    again = cache.clone()
    backend.impl().write_kv(kv_c, k_pe, again, batch.slot_mapping)
    assert again.equal(want)


def test_write_kv_with_a_steps_meta_refuses_other_slots_before_writing() -> None:
    spec = mla_spec(block_size=4)
    backend = TorchBackend(spec)
    batch, cache, _, kv_c, k_pe = _step(spec, [3, 1], [5, 2])
    before = cache.clone()
    with pytest.raises(InvalidInputError, match=r"slot_mapping is not meta\.batch\.slot_mapping"):
        backend.impl().write_kv(
            kv_c,
            k_pe,
            cache,
            batch.slot_mapping.clone(),
            meta=backend.metadata_builder().build(batch),
        )
    assert cache.equal(before)


@pytest.mark.parametrize(
    ("bad_scale", "match"),
    [
        (torch.tensor(0.5, dtype=torch.float64), "needs scale, a float32 scalar"),
        (torch.tensor([[0.5]]), "needs scale, a float32 scalar"),
        (torch.tensor(0.5, device="meta"), "cache scale is on meta"),
    ],
)
def test_a_scale_the_engine_attaches_after_construction_is_checked_before_writing(
    bad_scale: torch.Tensor, match: str
) -> None:
    """An engine attaches its own scale tensor to an fp8 latent cache (docs/concepts.md: "an
    engine may attach its own tensors"; they are checked with the cache). Such a scale of
    another dtype, shape or device is refused before the write, by a layer that had accepted
    the cache before and by ``write_latent_kv``, the cache byte-identical. (A differential fuzz
    found a float64 scale accepted by the torch backend, read and written with it, and an
    untyped error from the flash emulator's write.)"""
    spec = mla_spec(dtype=torch.float32, block_size=4, kv_cache_dtype="fp8_e4m3")
    backend = TorchBackend(spec)
    impl = backend.impl()
    batch, cache, q, kv_c, k_pe = _step(spec, [1, 3], [6, 9])
    meta = backend.metadata_builder().build(batch)
    impl.forward(q, kv_c, k_pe, cache, meta)  # the cache accepted as built
    cache.scale = bad_scale
    before_c, before_pe = cache.kv_c.clone(), cache.k_pe.clone()
    with pytest.raises(InvalidInputError, match=match):
        impl.forward(q, kv_c, k_pe, cache, meta)
    with pytest.raises(InvalidInputError, match=match):
        attnhub.mla.write_latent_kv(spec, cache, kv_c, k_pe, batch.slot_mapping)
    assert same_bytes(cache.kv_c, before_c) and same_bytes(cache.k_pe, before_pe)


def test_an_fp8_latent_scale_of_shape_one_is_the_scalar_in_every_byte_and_output() -> None:
    """A paged KV cache takes a per-tensor scale of shape ``()`` or ``(1,)``; a latent cache
    took ``()`` only, and refused the other with InvalidInputError. It takes both now, and the
    same value writes the same bytes and reads back the same output either way."""
    spec = mla_spec(dtype=torch.bfloat16, block_size=8, kv_cache_dtype="fp8_e4m3")
    backend = TorchBackend(spec)
    got = []
    for shape in [(), (1,)]:
        batch, cache, q, kv_c, k_pe = _step(spec, [1, 6, 2], [13, 21, 9])
        cache = replace(cache, scale=torch.full(shape, 0.25))  # the constructor's checks
        meta = backend.metadata_builder().build(batch)
        out = backend.impl().forward(q, kv_c, k_pe, cache, meta)
        again = cache.clone()
        backend.impl().write_kv(kv_c, k_pe, again, batch.slot_mapping)
        got.append((out, cache.joint, again.joint))
    (out0, joint0, again0), (out1, joint1, again1) = got
    assert torch.equal(out0, out1)
    assert same_bytes(joint0, joint1) and same_bytes(again0, again1)


def test_a_decode_only_declaration_refuses_a_prefill_at_build() -> None:
    spec = mla_spec()
    batch, *_ = _step(spec, [1, 5], [9, 12])
    with pytest.raises(UnsupportedConfigurationError, match=r"request 1 .* chunked prefill"):
        DecodeOnly(spec).metadata_builder().build(batch)


def test_a_non_causal_step_of_multi_token_queries_is_refused_at_build() -> None:
    """MLA layers are causal (every MLA kernel computes bottom-right causal attention); a batch
    marked non-causal asks for (and attnhub.reference computes) each query row over every key
    of its sequence. Refused at build where that differs (a request of query_len > 1); a step
    of one-token queries is the same either way and is served. (A differential fuzz found the
    torch backend returning the causal answer to a non-causal step.)"""
    spec = mla_spec(dtype=torch.float32, block_size=4)
    backend = TorchBackend(spec)
    batch, *_ = _step(spec, [1, 5], [9, 12])
    with pytest.raises(UnsupportedConfigurationError, match=r"batch\.causal is False.*request 1"):
        backend.metadata_builder().build(replace(batch, causal=False))
    decodes, cache, q, kv_c, k_pe = _step(spec, [1, 1], [9, 12])
    meta = backend.metadata_builder().build(replace(decodes, causal=False))
    out = backend.impl().forward(q, kv_c, k_pe, cache, meta)
    want, _ = reference.paged_mla_absorbed(q, cache, meta.batch, spec)
    n, tol = decodes.num_actual_tokens, TorchBackend.capabilities.tolerance(spec.dtype)
    assert testing.mismatch(out[:n], want, tol) is None


@pytest.mark.parametrize(
    "spoil",
    [
        "rope_missing",
        "latent_narrow",
        "rope_wide",
        "query_width",
        "split_cache_where_joint_only",
        "meta_of_another_backend",
        "output_of_value_width",
    ],
)
def test_bad_calls_are_refused_before_the_cache_is_touched(spoil: str) -> None:
    spec = mla_spec()
    backend = DecodeOnly(spec)
    batch, cache, q, kv_c, k_pe = _step(spec, [1, 1], [9, 12])
    meta = backend.metadata_builder().build(batch)
    args: dict = dict(query=q, kv_c=kv_c, k_pe=k_pe, cache=cache, meta=meta)
    if spoil == "rope_missing":
        args["k_pe"] = None
    elif spoil == "latent_narrow":
        args["kv_c"] = kv_c[:, :-1]
    elif spoil == "rope_wide":
        args["k_pe"] = torch.zeros(k_pe.shape[0], 17, dtype=k_pe.dtype)
    elif spoil == "query_width":
        args["query"] = testing.random_mla_query(
            spec, q.shape[0], testing.generator(1), form="expanded"
        )
    elif spoil == "split_cache_where_joint_only":
        args["cache"] = LatentKVCache.for_spec(spec, cache.num_blocks, layout="split")
    elif spoil == "meta_of_another_backend":
        args["meta"] = TorchBackend(spec).metadata_builder().build(batch)
    elif spoil == "output_of_value_width":
        args["output"] = torch.zeros(q.shape[0], 4, 32, dtype=spec.dtype)
    before = args["cache"].clone()
    with pytest.raises(InvalidInputError):
        backend.impl().forward(**args)
    assert args["cache"].equal(before)


def test_mla_impl_is_the_protocol_a_backend_implements() -> None:
    assert {"store_kv", "attend"} <= MLAImpl.__abstractmethods__


# --- the CLI ---------------------------------------------------------------------------------
MLA_SELECT = ["select", "--heads", "16", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64"]


def test_select_takes_an_mla_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MLA_SELECT, "--prefer", "torch"]) == 0
    assert "selected: torch" in capsys.readouterr().out


def test_select_refuses_standard_flags_on_an_mla_layer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MLA_SELECT, "--head-size", "128"]) == 2
    assert "--head-size: not flags of an MLA layer" in capsys.readouterr().err


def test_list_says_what_each_backend_serves_of_mla(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "mla absorbed form: bfloat16, float16, float32; kv caches auto, fp8_e4m3" in out
