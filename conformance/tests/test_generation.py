"""Cases grow from declarations: what is declared is tested, what is not is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attnhub_conformance.cases import DECODER_SHAPES, FULL, QUICK, BatchPlan, generate
from attnhub_conformance.harness import random_block_table
from attnhub_conformance.hostsync import HostSyncError, guard, guard_tree
from attnhub_conformance.targets import Target

from attnhub import FEATURES, GraphSupport, LseSupport
from attnhub.torch_backend import TorchBackend


def target_for(cls: type[TorchBackend], name: str = "t") -> Target:
    return Target(name=name, device="cpu", emulate=False, backend=cls)


def all_rows(kind: str, target: Target, scope=QUICK) -> set[str]:
    return {row for case in generate(kind, target, scope) for row in case.rows}


def test_every_declared_feature_and_shape_is_tested() -> None:
    rows = all_rows("outputs", target_for(TorchBackend))
    assert {f"feature: {f}" for f in FEATURES} <= rows
    assert {f"batch: {s.name}" for s in DECODER_SHAPES} <= rows
    assert {
        "dtype: bf16",
        "dtype: fp16",
        "dtype: fp32",
        "head size: 64",
        "head size: 128",
        "heads: mha",
        "heads: gqa4",
        "heads: mqa",
        "kv cache: fp8_e4m3",
        "attention: encoder_decoder",
    } <= rows


def test_case_ids_name_the_backend_and_the_configuration() -> None:
    ids = {c.id for c in generate("outputs", target_for(TorchBackend, "torch"), QUICK)}
    assert "torch-chunked_prefill-bf16-h64-gqa4-bs16-sliding_window" in ids
    assert "torch-mixed-bf16-h128-gqa4-bs16" in ids


class Narrow(TorchBackend):
    name = "narrow"
    capabilities = replace(
        TorchBackend.capabilities,
        dtypes=frozenset({torch.float16}),
        head_sizes=frozenset({128}),
        block_sizes=frozenset({32}),
        softcap=False,
        alibi=False,
        kv_cache_dtypes=frozenset({"auto"}),
        multi_token_decode=False,
        graph_capture=GraphSupport.NEVER,
    )


def test_undeclared_capabilities_become_refusal_cases() -> None:
    target = target_for(Narrow, "narrow")
    outputs = generate("outputs", target, QUICK)
    assert outputs and all(c.config.dtype == torch.float16 for c in outputs)
    assert all((c.config.head_size, c.config.block_size) == (128, 32) for c in outputs)
    assert "batch: multi_token_decode" not in {r for c in outputs for r in c.rows}
    refusals = {c.name for c in generate("refusals", target, QUICK)}
    assert {
        "dtype_bf16",
        "dtype_fp32",
        "feature_softcap",
        "feature_alibi",
        "kv_cache_fp8_e4m3",
        "multi_token_decode",
        "cascade",
        "graph_capture",
    } <= refusals
    assert any(n.startswith("head_size_") for n in refusals)
    assert any(n.startswith("block_size_") for n in refusals)


def test_full_scope_is_wider_than_quick() -> None:
    t = target_for(TorchBackend)
    quick, full = generate("outputs", t, QUICK), generate("outputs", t, FULL)
    assert len(full) > 2 * len(quick)
    assert max(s for c in full for _, s in c.plan().requests) > 2048  # long context


def test_block_tables_are_shuffled_and_leave_block_zero_unused() -> None:
    plan = BatchPlan(((1, 40), (5, 5), (3, 70)), shared_prefix_blocks=0)
    table, num_blocks = random_block_table(plan, 16, torch.Generator().manual_seed(0))
    used = [int(b) for r, (_, s) in enumerate(plan.requests) for b in table[r, : -(-s // 16)]]
    assert 0 not in used and len(set(used)) == len(used)
    assert max(used) < num_blocks and used != sorted(used)


def test_host_sync_guard_raises_on_host_reads() -> None:
    t = guard(torch.arange(4), "a test tensor")
    reads = (
        lambda: t[0].item(),
        t.tolist,
        lambda: bool(t[0]),
        t.cpu,
        lambda: int(t[1]),
        lambda: [0, 1, 2][t[1]],
        lambda: bool((t > 0).all()),
        t.nonzero,
        lambda: t.to("cpu"),
        lambda: t.to(device=torch.device("cpu"), dtype=torch.int32),
    )
    for read in reads:
        with pytest.raises(HostSyncError):
            read()
    assert (t + 1).sum().shape == ()  # device-side work is fine
    assert t.to(torch.int32).dtype == torch.int32  # a dtype change stays on the device


def test_host_reads_inside_device_code_are_allowed() -> None:
    """An emulator stands in for the device: a module marked ``__attnhub_device_code__`` may
    read guarded tensors (its reads happen on the device); the same read elsewhere fails."""
    t = guard(torch.arange(4), "a test tensor")
    device_code: dict[str, object] = {"__attnhub_device_code__": True}
    exec("def kernel(x):\n    return int(x.sum().item())", device_code)
    assert device_code["kernel"](t) == 6  # type: ignore[operator]
    host_code: dict[str, object] = {}
    exec("def backend(x):\n    return int(x.sum().item())", host_code)
    with pytest.raises(HostSyncError):
        host_code["backend"](t)  # type: ignore[operator]


def test_guard_tree_leaves_host_copies_alone() -> None:
    from attnhub import BatchMetadata

    batch = BatchMetadata.from_lengths([1, 2], [5, 2], [[1], [2]], 16)
    guarded = guard_tree(batch, "batch")
    assert type(guarded.slot_mapping).__name__ == "HostSyncGuard"
    assert type(guarded.seq_lens_cpu) is torch.Tensor
    assert batch.slot_mapping.__class__ is torch.Tensor  # the original is untouched


def test_long_contexts_cross_the_split_threshold_quick_and_reach_128k_full() -> None:
    """Quick: one decode just past the torch planner's gather budget (4 MiB of K/V: a request
    planned alone); full: 32k keys in every dtype, a chunked prefill over 32k, one near 128k."""
    from attnhub_conformance.cases import LONG_KEYS, LONGEST_KEYS, split_threshold_keys

    target = target_for(TorchBackend)
    quick = generate("long_context", target, QUICK)
    assert {r for c in quick for r in c.rows} == {"long context: past the split threshold"}
    (case,) = quick
    assert case.config is not None
    budget_tokens = TorchBackend.gather_budget_bytes // (
        case.config.heads.num_kv_heads * case.config.head_size * 2 * 2
    )
    assert split_threshold_keys(target, case.config) >= budget_tokens
    assert max(case.plan().seq_lens) > budget_tokens
    full = generate("long_context", target, FULL)
    rows = [r for c in full for r in c.rows]
    decodes = [c for c in full if c.rows == ("long context: decode 32k",)]
    assert {c.config.dtype for c in decodes if c.config} == {
        torch.bfloat16,
        torch.float16,
        torch.float32,
    }
    assert {f for c in decodes if c.config for f in c.config.features} == set(FEATURES)
    longest = {max(c.plan().seq_lens) for c in full}
    assert max(longest) > LONGEST_KEYS and min(k for k in longest if k > LONG_KEYS) > LONG_KEYS
    assert "long context: chunked prefill 32k" in rows


def test_noncontiguous_and_extreme_logit_cases_follow_the_declarations() -> None:
    rows = all_rows("extreme_logits", target_for(TorchBackend))
    assert rows == {
        "extreme logits: scores ~1e4",
        "extreme logits: all logits equal",
        "extreme logits: at the softcap limit",
        "extreme logits: very negative ALiBi",
    }
    narrow = all_rows("extreme_logits", target_for(Narrow))  # no softcap, no ALiBi declared
    assert narrow == {"extreme logits: scores ~1e4", "extreme logits: all logits equal"}
    per_dtype = generate("extreme_logits", target_for(TorchBackend), QUICK)
    assert {c.config.dtype for c in per_dtype if c.entry == "large_scores"} == {
        torch.bfloat16,
        torch.float16,
        torch.float32,
    }
    assert all_rows("noncontiguous", target_for(Narrow)) == {"non-contiguous q/k/v and output"}


class LseForFloat16(TorchBackend):
    name = "lse_fp16"
    capabilities = replace(
        TorchBackend.capabilities,
        lse=LseSupport(dtypes=frozenset({torch.float16}), reason="the kernel's"),
    )


def test_lse_cases_follow_the_declaration() -> None:
    torch_cases = generate("lse", target_for(TorchBackend), QUICK)
    assert {c.rows for c in torch_cases} == {("lse",)}
    assert {c.entry for c in torch_cases} == {"value", "merge"}
    assert {c.config.dtype for c in torch_cases if c.entry == "value"} == {
        torch.bfloat16,
        torch.float16,
        torch.float32,
    }
    assert any(c.config.features for c in torch_cases)  # every feature at once (sinks too)
    # and each feature alone: a window that cuts keys can hide what ALiBi does to a kernel's LSE
    alone = {c.config.features for c in torch_cases if len(c.config.features) == 1}
    assert alone == {(f,) for f in FEATURES if TorchBackend.capabilities.supports_feature(f)}
    assert {c.config.kv_cache_dtype for c in torch_cases} >= {"auto", "fp8_e4m3"}
    # declared for one dtype: the others are refusals, reported as not supported
    partial = generate("lse", target_for(LseForFloat16), QUICK)
    refused = {c.config.dtype for c in partial if c.entry == "refused"}
    assert refused == {torch.bfloat16, torch.float32}
    assert all(c.not_supported for c in partial if c.entry == "refused")
    assert not any(c.not_supported for c in partial if c.entry != "refused")
    # declared nowhere: refusals alone, no merge
    none = replace(TorchBackend.capabilities, lse=LseSupport())
    quiet = type("NoLse", (TorchBackend,), {"name": "no_lse", "capabilities": none})
    assert {c.entry for c in generate("lse", target_for(quiet), QUICK)} == {"refused"}


class LseWithoutSinks(TorchBackend):
    name = "lse_no_sinks"
    capabilities = replace(
        TorchBackend.capabilities,
        lse=LseSupport(dtypes=TorchBackend.capabilities.dtypes, sinks=False, reason="the kernel's"),
    )


def test_lse_cases_without_sinks_refuse_them_and_still_check_the_other_features() -> None:
    cases = generate("lse", target_for(LseWithoutSinks), QUICK)
    refused = [c for c in cases if c.entry == "refused"]
    assert refused and all("sinks" in c.config.features for c in refused)
    valued = [c.config.features for c in cases if c.entry == "value"]
    together = [f for f in valued if len(f) > 1]
    assert together and all("sinks" not in f for f in valued)
    assert {"sliding_window", "softcap", "alibi"} <= set(together[0])


def test_multi_rank_cases_follow_the_lse_declaration() -> None:
    quick = generate("multi_rank", target_for(TorchBackend), QUICK)
    assert [(c.entry, c.skip, c.rows) for c in quick] == [
        ("2", None, ("multi-rank: decode context parallel 2 ranks",))
    ]
    assert [c.entry for c in generate("multi_rank", target_for(TorchBackend), FULL)] == ["2", "4"]
    # declared for one dtype: run in that dtype
    (partial,) = generate("multi_rank", target_for(LseForFloat16), QUICK)
    assert partial.skip is None and partial.config.dtype == torch.float16
    # declared nowhere: skipped with the declaration's reason, reported as not supported
    none = replace(TorchBackend.capabilities, lse=LseSupport(reason="no LSE in these kernels"))
    quiet = type("NoLse", (TorchBackend,), {"name": "no_lse", "capabilities": none})
    (refused,) = generate("multi_rank", target_for(quiet), QUICK)
    assert refused.not_supported and "no LSE in these kernels" in refused.skip
    assert "decode context parallel needs the LSE" in refused.skip
    # the groups are gloo's, on the host
    (elsewhere,) = generate("multi_rank", replace(target_for(TorchBackend), device="meta"), QUICK)
    assert elsewhere.skip is not None and "gloo" in elsewhere.skip


def test_multi_rank_mla_cases_follow_the_mla_lse_declaration() -> None:
    """A case per group size where the MLA LSE is declared, in the finest declared dtype, with
    a head count the backend serves per rank and gathered; the MLA LSE refused: skipped with
    its reason; no MLA declared: no case."""
    from attnhub import MlaSupport

    quick = generate("multi_rank_mla", target_for(TorchBackend), QUICK)
    assert [(c.entry, c.skip, c.rows) for c in quick] == [
        ("2", None, ("multi-rank: decode context parallel of MLA layers 2 ranks",))
    ]
    assert quick[0].mla.dtype == torch.float32 and quick[0].mla.num_heads == 2
    full = generate("multi_rank_mla", target_for(TorchBackend), FULL)
    assert [c.entry for c in full] == ["2", "4"]
    # the kernels take 32, 64 and 128 heads: 32 per rank, 64 or 128 gathered
    tiles = replace(
        TorchBackend.capabilities,
        mla=replace(TorchBackend.capabilities.mla, num_heads=frozenset({32, 64, 128})),
    )
    tiled = type("Tiled", (TorchBackend,), {"name": "tiled", "capabilities": tiles})
    heads = [c.mla.num_heads for c in generate("multi_rank_mla", target_for(tiled), FULL)]
    assert heads == [32, 32]
    no_lse = replace(
        TorchBackend.capabilities,
        mla=replace(TorchBackend.capabilities.mla, lse=LseSupport(reason="no MLA LSE here")),
    )
    quiet = type("NoMlaLse", (TorchBackend,), {"name": "no_mla_lse", "capabilities": no_lse})
    (refused,) = generate("multi_rank_mla", target_for(quiet), QUICK)
    assert refused.not_supported and "no MLA LSE here" in refused.skip
    none = replace(TorchBackend.capabilities, mla=MlaSupport())
    plain = type("NoMla", (TorchBackend,), {"name": "no_mla", "capabilities": none})
    assert generate("multi_rank_mla", target_for(plain), QUICK) == []
    on_meta = replace(target_for(TorchBackend), device="meta")
    (elsewhere,) = generate("multi_rank_mla", on_meta, QUICK)
    assert elsewhere.skip is not None and "gloo" in elsewhere.skip


class MlaRefusedOnThisDevice(TorchBackend):
    """Declares MLA (the torch backend's declaration) and, as a native backend on a GPU
    without the kernels does, refuses every MLA layer at construction only."""

    name = "mla-refused-here"

    def __init__(self, spec, device="cpu", *, emulate=False, **kw):
        from attnhub.errors import UnsupportedConfigurationError
        from attnhub.mla import MLASpec

        if isinstance(spec, MLASpec):
            raise UnsupportedConfigurationError(self.name, ["no MLA kernels on this device"])
        super().__init__(spec, device, emulate=emulate, **kw)


class MlaBlockMismatch(TorchBackend):
    """Declares MLA blocks it then refuses: a declaration bug, which must fail, not pass as
    'not supported'."""

    name = "mla-block-mismatch"

    @classmethod
    def mla_unsupported_reasons(cls, spec):
        from attnhub.capabilities import Refusal

        reasons = super().mla_unsupported_reasons(spec)
        return [*reasons, Refusal("block_size 16 is not served", field="mla.block_size", value=16)]


def test_a_declared_mla_the_device_refuses_at_construction_is_one_refusal_case() -> None:
    """vLLM's FA3 providers refuse an MLA layer at construction off Hopper, their declaration
    unchanged (flash's fa4 on an H100, 2026-11-26: every MLA output case failed there). A
    refusal of one declared field is not that: its output cases stay, to fail."""
    from attnhub_conformance.test_mla import test_mla

    cases = generate("mla", target_for(MlaRefusedOnThisDevice, "here"), QUICK)
    assert [(c.entry, c.rows, c.not_supported) for c in cases] == [
        ("refused_here", ("mla: absorbed form",), True)
    ]
    test_mla(cases[0])  # construction is refused
    mismatch = generate("mla", target_for(MlaBlockMismatch, "mismatch"), QUICK)
    assert sum(c.entry == "output" for c in mismatch) > 5
