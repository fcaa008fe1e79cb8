"""The flash backend's MLA layers: the value query in the emulator (``q_v`` of vLLM's fork,
``qv`` of upstream FA3: what flash_api.cpp takes, refused where it refuses; ``qv`` of FA4 on
Blackwell: what its interface asserts) and the backend's one latent write and one attention
call per layer, each checked against ``attnhub.reference``; the providers without the op
refuse MLA with their reason."""

from __future__ import annotations

from typing import Any

import flash_helpers
import pytest
import torch
from attnhub_flash import BACKENDS, emulator
from attnhub_flash.emulator import FlashOpError, NotEmulatedError

from attnhub import BatchMetadata, LatentKVCache, MLASpec, reference, testing
from attnhub.capabilities import Tolerance
from attnhub.errors import UnsupportedConfigurationError

FORK = emulator.VLLM.flash_attn_varlen_func
FA3 = emulator.FA3.flash_attn_with_kvcache
FA4 = emulator.FA4.flash_attn_varlen_func
H, R, P, NB, BS = 4, 512, 64, 8, 16
TOL = Tolerance(atol=2e-2, rtol=2e-2)
MLA_PROVIDERS = ("vllm-fa3", "fa3", "fa4")
FA3_MLA_PROVIDERS = ("vllm-fa3", "fa3")


def mla_spec(**changes: Any) -> MLASpec:
    return flash_helpers.mla_spec(**{"block_size": BS, **changes})


class Call:
    """One value-query call over a random joint latent plane, as FLASH_ATTN_MLA makes it."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], r: int = R, p: int = P):
        g = testing.generator(3)
        self.r, self.p = r, p
        self.plane = torch.randn(NB, BS, r + p, generator=g).bfloat16()
        self.query = torch.randn(sum(query_lens), H, r + p, generator=g).bfloat16()
        blocks = -(-max(seq_lens) // BS)
        perm = torch.randperm(NB, generator=g)[:blocks].to(torch.int32)
        self.table = torch.stack([perm.roll(i) for i in range(len(seq_lens))])
        self.query_lens, self.seq_lens = query_lens, seq_lens
        self.cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
        self.seqused = torch.tensor(seq_lens, dtype=torch.int32)

    def parts(self) -> dict[str, torch.Tensor]:
        r = self.r
        return dict(
            q=self.query[..., r:],
            k=self.plane[..., r:].unsqueeze(-2),
            v=self.plane[..., :r].unsqueeze(-2),
            qv=self.query[..., :r],
        )

    def fork(self, **changes: Any) -> Any:
        t = self.parts()
        kwargs: dict[str, Any] = dict(
            q=t["q"],
            k=t["k"],
            v=t["v"],
            q_v=t["qv"],
            max_seqlen_q=max(self.query_lens),
            cu_seqlens_q=self.cu,
            max_seqlen_k=max(self.seq_lens),
            seqused_k=self.seqused,
            block_table=self.table,
            softmax_scale=0.07,
            causal=True,
            return_softmax_lse=True,
            fa_version=3,
        )
        kwargs.update(changes)
        return FORK(**kwargs)

    def upstream(self, **changes: Any) -> Any:
        t = self.parts()
        kwargs: dict[str, Any] = dict(
            qv=t["qv"],
            cache_seqlens=self.seqused,
            page_table=self.table,
            cu_seqlens_q=self.cu,
            max_seqlen_q=max(self.query_lens),
            softmax_scale=0.07,
            causal=True,
            return_softmax_lse=True,
        )
        kwargs.update(changes)
        return FA3(kwargs.pop("q", t["q"]), t["k"], kwargs.pop("v", t["v"]), **kwargs)

    def fa4(self, **changes: Any) -> Any:
        t = self.parts()
        kwargs: dict[str, Any] = dict(
            qv=t["qv"],
            cu_seqlens_q=self.cu,
            max_seqlen_q=max(self.query_lens),
            seqused_k=self.seqused,
            max_seqlen_k=max(self.seq_lens),
            page_table=self.table,
            softmax_scale=0.07,
            causal=True,
            return_lse=True,
        )
        kwargs.update(changes)
        return FA4(kwargs.pop("q", t["q"]), t["k"], kwargs.pop("v", t["v"]), **kwargs)

    def expected(self, scale: float = 0.07) -> tuple[torch.Tensor, torch.Tensor]:
        spec = mla_spec(kv_lora_rank=self.r, qk_rope_head_dim=self.p, scale=scale)
        cache = LatentKVCache.from_joint(self.plane, self.r)
        batch = BatchMetadata.from_lengths(self.query_lens, self.seq_lens, self.table, BS)
        return reference.paged_mla_absorbed(self.query, cache, batch, spec)


# --- the emulator's value query ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [17, 3, 40]), ([2, 1, 16], [20, 9, 33])],
    ids=["decodes", "short-queries"],
)
@pytest.mark.parametrize("api", ["fork", "upstream"])
def test_the_value_query_scores_q_k_plus_qv_v_over_v(
    api: str, query_lens: list[int], seq_lens: list[int]
) -> None:
    call = Call(query_lens, seq_lens)
    out, lse = (call.fork() if api == "fork" else call.upstream())[:2]
    want, want_lse = call.expected()
    assert out.shape == (sum(query_lens), H, R) and out.dtype == torch.bfloat16
    assert testing.mismatch(out, want, TOL) is None
    assert torch.allclose(lse, want_lse.float(), atol=1e-3)  # both [H, total_q]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([1, 1, 1], [17, 3, 40]), ([2, 1, 16], [20, 9, 33])],
    ids=["decodes", "short-queries"],
)
def test_fa4s_qv_scores_q_k_plus_qv_v_over_v_with_the_lse_heads_last(
    query_lens: list[int], seq_lens: list[int]
) -> None:
    # "O = softmax(scale * (Q @ K.T + Qv @ V.T)) @ V"; lse "(total_q, nheads) if has_qv" [doc]
    call = Call(query_lens, seq_lens)
    out, lse = call.fa4()
    want, want_lse = call.expected()
    assert out.shape == (sum(query_lens), H, R) and out.dtype == torch.bfloat16
    assert testing.mismatch(out, want, TOL) is None
    assert lse.shape == (sum(query_lens), H)
    assert torch.allclose(lse, want_lse.float().t(), atol=1e-3)
    # its default scale is q's and qv's head dims together [schema]
    default = call.fa4(softmax_scale=None)[0]
    assert testing.mismatch(default, call.expected((P + R) ** -0.5)[0], TOL) is None


def test_fa4s_qv_is_refused_where_its_interface_asserts(monkeypatch: pytest.MonkeyPatch) -> None:
    call = Call([1, 2], [9, 20])
    with pytest.raises(AssertionError, match="local not yet supported with qv"):
        call.fa4(window_size=(8, 0))
    with pytest.raises(AssertionError, match="q, k, v, and qv must have the same dtype"):
        call.fa4(qv=call.parts()["qv"].half())
    with pytest.raises(AssertionError, match="qv must have shape"):
        call.fa4(qv=call.parts()["qv"][:1])
    with pytest.raises(AssertionError, match="head_dim 64 and head_dim_v 512"):
        Call([1], [9], r=128, p=64).fa4()
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90a")
    with pytest.raises(FlashOpError, match=r"\(64, 512\) is not supported on SM90"):
        call.fa4()
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_120")
    with pytest.raises(AssertionError, match=r"Paged KV not supported on SM 12\.0"):
        call.fa4()


def test_the_value_query_is_part_of_the_scores() -> None:
    """Not an ordinary attention of q over k that happens to return v: q_v changes the output."""
    call = Call([1, 2], [30, 12])
    out = call.fork()[0]
    other = call.fork(q_v=torch.zeros_like(call.parts()["qv"]))[0]
    assert testing.mismatch(out, other, TOL) is not None


def test_the_default_scale_is_q_alone_in_the_fork_and_q_plus_qv_upstream() -> None:
    call = Call([1], [25])
    fork = call.fork(softmax_scale=None)[0]
    upstream = call.upstream(softmax_scale=None)[0]
    assert testing.mismatch(fork, call.expected(P**-0.5)[0], TOL) is None
    assert testing.mismatch(upstream, call.expected((P + R) ** -0.5)[0], TOL) is None


@pytest.mark.parametrize(
    ("r", "p", "match"),
    [
        (512, 128, "head_size <= 64"),
        (128, 64, "hdim_v >= 256"),
        (520, 64, r"\(Q/K <= 64 and V <= 512\)"),
        (512, 60, "multiples of 8"),
    ],
)
def test_head_sizes_flash_api_refuses_with_a_value_query_are_refused(
    r: int, p: int, match: str
) -> None:
    call = Call([1], [9], r=r, p=p)
    with pytest.raises(FlashOpError, match=match):
        call.fork()
    with pytest.raises(FlashOpError, match=match):
        call.upstream()


def test_a_value_query_of_another_shape_or_dtype_is_refused() -> None:
    call = Call([1, 1], [9, 4])
    qv = call.parts()["qv"]
    with pytest.raises(FlashOpError, match="q_v must have shape"):
        call.fork(q_v=qv[:1])
    with pytest.raises(FlashOpError, match="q_v must have the same dtype"):
        call.fork(q_v=qv.half())
    with pytest.raises(FlashOpError, match="fp16 and bf16"):
        t = call.parts()
        call.fork(q=t["q"].float(), k=t["k"].float(), v=t["v"].float(), q_v=qv.float())


def test_fa_version_2_drops_q_v_and_fa2_refuses_the_mla_shapes() -> None:
    """The fork's wrapper passes q_v to FA3 and FA4 only: FA2's varlen_fwd sees k and v of
    different head sizes and refuses them."""
    call = Call([1], [9])
    with pytest.raises(FlashOpError, match="must have the same shape"):
        call.fork(fa_version=2, scheduler_metadata=None)


def test_the_forks_fa3_pages_are_multiples_of_16() -> None:
    call = Call([1], [9])
    t = call.parts()
    k = t["k"].reshape(NB * 2, BS // 2, 1, P)
    v = t["v"].reshape(NB * 2, BS // 2, 1, R)
    with pytest.raises(FlashOpError, match="multiple of 16"):
        call.fork(k=k, v=v, block_table=call.table * 2)


def test_a_padded_batch_value_query_is_not_emulated() -> None:
    call = Call([1], [9])
    t = call.parts()
    with pytest.raises(NotEmulatedError, match="qv"):
        FA3(
            t["q"].unsqueeze(1),
            t["k"],
            t["v"],
            qv=t["qv"].unsqueeze(1),
            cache_seqlens=call.seqused,
            page_table=call.table,
        )


# --- the backend ---------------------------------------------------------------------------------


def _step(provider: str, requests: list[tuple[int, int]], **changes: Any) -> tuple[Any, ...]:
    spec = mla_spec(**changes)
    backend = BACKENDS[provider](spec, "cpu", emulate=True)
    step = testing.random_mla_step(backend, requests)
    assert step.cache.layout == "joint"
    return spec, backend, step.batch, step.cache, step.query, step.kv_c, step.k_pe


CALLS = {  # fa3 has no write op: its write is the kit's scatter
    "vllm-fa3": [
        "vllm._custom_ops.concat_and_cache_mla",
        "vllm.vllm_flash_attn.flash_attn_varlen_func",
    ],
    "fa3": ["flash_attn_interface.flash_attn_with_kvcache"],
    "fa4": ["flash_attn.cute.flash_attn_varlen_func"],
}


@pytest.mark.parametrize("provider", MLA_PROVIDERS)
@pytest.mark.parametrize(
    "requests", [[(1, 17), (1, 3), (1, 40)], [(3, 20), (1, 9), (16, 16)]], ids=["decodes", "mixed"]
)
def test_a_layer_makes_one_write_and_one_value_query_call(
    provider: str, requests: list[tuple[int, int]]
) -> None:
    spec, backend, batch, cache, query, kv_c, k_pe = _step(provider, requests)
    want_cache = cache.clone()
    reference.write_latent_kv(want_cache, kv_c, k_pe, batch.slot_mapping)
    meta = backend.metadata_builder().build(batch)
    with emulator.record_calls() as calls:
        out, lse = backend.impl().forward(query, kv_c, k_pe, cache, meta, return_lse=True)
    assert [c.name for c in calls] == CALLS[provider]
    kwargs = calls[-1].kwargs
    qv = kwargs["q_v" if provider == "vllm-fa3" else "qv"]
    assert qv.shape[-1] == R and kwargs["causal"] is True
    assert kwargs["softmax_scale"] == spec.scale
    assert cache.equal(want_cache)
    want, want_lse = reference.paged_mla_absorbed(query, cache, batch, spec)
    n = batch.num_actual_tokens
    assert testing.mismatch(out[:n], want, TOL) is None
    assert torch.allclose(lse[:n], want_lse.float().t(), atol=1e-3)
    assert bool((out[n:] == 0).all())


def test_the_forks_schedule_is_planned_once_per_step_for_the_mla_shapes() -> None:
    _, backend, batch, *_ = _step("vllm-fa3", [(1, 17), (2, 30)])
    with emulator.record_calls() as calls:
        meta = backend.metadata_builder().build(batch)
    assert [c.name for c in calls] == ["vllm.vllm_flash_attn.get_scheduler_metadata"]
    planned = calls[0].kwargs
    assert (planned["headdim"], planned["headdim_v"], planned["num_heads_kv"]) == (P, R, 1)
    assert meta.kwargs["scheduler_metadata"] is not None and meta.kwargs["fa_version"] == 3


@pytest.mark.parametrize("provider", MLA_PROVIDERS)
def test_write_kv_alone_skips_padding_slots(provider: str) -> None:
    _, backend, batch, cache, _, kv_c, k_pe = _step(provider, [(2, 5), (1, 9)])
    slots = batch.slot_mapping.clone()
    slots[1] = -1
    want = cache.clone()
    reference.write_latent_kv(want, kv_c, k_pe, slots)
    backend.impl().write_kv(kv_c, k_pe, cache, slots)
    assert cache.equal(want)


@pytest.mark.parametrize("provider", ["vllm", "fa2"])
def test_providers_without_a_value_query_refuse_mla_with_their_reason(provider: str) -> None:
    with pytest.raises(UnsupportedConfigurationError, match=f"provider {provider}"):
        BACKENDS[provider](mla_spec(), "cpu", emulate=True)


def test_fa4_refuses_mla_off_blackwell(monkeypatch: pytest.MonkeyPatch) -> None:
    """FA4's qv: 'only support Blackwell arch with qv' [source]; the architecture is the one
    FA4 selects (FLASH_ATTENTION_ARCH, else the GPU), for selection and for a native layer."""
    kernels = BACKENDS["fa4"].kernels
    for arch, refused in (("sm_90a", True), ("sm_100a", False), ("sm_110", False)):
        monkeypatch.setenv("FLASH_ATTENTION_ARCH", arch)
        reasons = BACKENDS["fa4"].unsupported_reasons(mla_spec())
        assert [r.field for r in reasons] == (["mla"] if refused else []), arch
        assert bool(kernels.device_refusals(mla_spec(), torch.device("cuda"))) == refused
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90a")
    with pytest.raises(UnsupportedConfigurationError, match="Blackwell"):
        BACKENDS["fa4"](mla_spec(), "cpu", emulate=True)


def test_the_suite_tests_a_declared_mla_that_this_gpu_refuses_as_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an H100 the fa4 provider's MLA, declared at import for Blackwell, is refused at
    construction: the suite made its output cases anyway and failed every one (21 on the H100,
    2026-11-26). Here the architecture changes after import, as the GPU's does there."""
    from attnhub_conformance.cases import QUICK, generate
    from attnhub_conformance.targets import Target
    from attnhub_conformance.test_mla import test_mla

    target = Target(name="flash", device="cpu", emulate=True, backend=BACKENDS["fa4"])
    if not BACKENDS["fa4"].capabilities.mla.declared:
        pytest.skip("FLASH_ATTENTION_ARCH named a GPU without FA4's MLA when attnhub_flash loaded")
    assert len(generate("mla", target, QUICK)) > 10  # on Blackwell: every output case
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90a")
    cases = generate("mla", target, QUICK)
    assert [(c.rows, c.not_supported) for c in cases] == [(("mla: absorbed form",), True)]
    test_mla(cases[0])  # the construction is refused with the declaration's reason


@pytest.mark.parametrize(
    ("provider", "changes", "field"),
    [
        ("vllm-fa3", {"block_size": 8}, "mla.block_size"),
        ("fa3", {"kv_lora_rank": 128}, "mla.latent_size"),
        ("fa3", {"qk_rope_head_dim": 128}, "mla.latent_size"),
        ("fa3", {"kv_lora_rank": 384}, "mla.latent_size"),
        ("vllm-fa3", {"kv_cache_dtype": "fp8_e4m3"}, "mla.kv_cache_dtype"),
        ("fa3", {"dtype": torch.float32}, "mla.dtype"),
        ("fa4", {"kv_lora_rank": 256}, "mla.latent_size"),
    ],
)
def test_what_the_value_query_does_not_take_is_refused_with_its_reason(
    provider: str, changes: dict[str, Any], field: str
) -> None:
    reasons = BACKENDS[provider].unsupported_reasons(mla_spec(**changes))
    assert [r.field for r in reasons] == [field]
    with pytest.raises(UnsupportedConfigurationError, match=r"FA3's value|paged blocks|FA4's qv"):
        BACKENDS[provider](mla_spec(**changes), "cpu", emulate=True)


@pytest.mark.parametrize("provider", FA3_MLA_PROVIDERS)
def test_a_native_mla_layer_needs_hopper(provider: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """FA3 (upstream) runs on sm80 too, but its value query only on 9.x."""
    kernels = BACKENDS[provider].kernels
    for cap, refused in (((8, 0), True), ((9, 0), False), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=cap: c)
        reasons = kernels.device_refusals(mla_spec(), torch.device("cuda"))
        assert bool(reasons) == refused, (cap, reasons)
        assert not reasons or "Hopper" in reasons[0]


@pytest.mark.parametrize("provider", MLA_PROVIDERS)
def test_deepseeks_latent_and_block_sizes_are_served(provider: str) -> None:
    for bs in (16, 64):
        assert BACKENDS[provider].unsupported_reasons(mla_spec(block_size=bs)) == []
    assert BACKENDS["fa3"].unsupported_reasons(mla_spec(block_size=8)) == []  # any page size


# --- vLLM's concat_and_cache_mla ------------------------------------------------------------------


def _latent_write(n: int = 5) -> tuple[torch.Tensor, ...]:
    g = testing.generator(4)
    kv_c = torch.randn(n + 2, R, generator=g).bfloat16()  # two padding rows past the slots
    k_pe = torch.randn(n + 2, P, generator=g).bfloat16()
    plane = torch.randn(NB, BS, R + P, generator=g).bfloat16()
    slots = torch.tensor([3, -1, 40, 17, 127][:n], dtype=torch.int64)
    return kv_c, k_pe, plane, slots


def test_concat_and_cache_mla_writes_kv_c_then_k_pe_per_slot_and_skips_padding() -> None:
    kv_c, k_pe, plane, slots = _latent_write()
    want = LatentKVCache.from_joint(plane.clone(), R)
    reference.write_latent_kv(want, kv_c[:5], k_pe[:5], slots)
    emulator.VLLM_CACHE_OPS.concat_and_cache_mla(kv_c, k_pe, plane, slots, "auto", torch.ones(1))
    assert torch.equal(plane, want.joint)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"slots": "int32"}, "slot_mapping must be int64"),
        ({"slots": "strided"}, "slot_mapping must be contiguous"),
        ({"k_pe": "narrow"}, "kv_lora_rank \\+ pe_dim"),
        ({"slots": "outside"}, "outside the cache"),
        ({"kv_c": "fp16"}, "differ"),
    ],
)
def test_concat_and_cache_mla_refuses_what_the_kernel_cannot_write(
    change: dict[str, str], match: str
) -> None:
    kv_c, k_pe, plane, slots = _latent_write()
    before = plane.clone()
    what = next(iter(change.values()))
    if what == "int32":
        slots = slots.int()
    elif what == "strided":
        slots = torch.stack([slots, slots], 1)[:, 0]
    elif what == "narrow":
        k_pe = k_pe[:, :-8]
    elif what == "outside":
        slots = slots.clone()
        slots[0] = NB * BS
    elif what == "fp16":
        kv_c = kv_c.half()
    with pytest.raises(FlashOpError, match=match):
        emulator.VLLM_CACHE_OPS.concat_and_cache_mla(
            kv_c, k_pe, plane, slots, "auto", torch.ones(1)
        )
    assert torch.equal(plane, before)
