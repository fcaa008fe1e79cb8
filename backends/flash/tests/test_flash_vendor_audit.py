"""The FlashAttention points of the vendor audit (calls that would crash on a GPU, read against
flash-attn 2.8.3, flash-attn-4 4.0.0b36, vLLM's fork and vLLM 0.32's copy of it) and of the
reliability fuzz (strided integer metadata): each a regression test of the backend's
declaration or translation and of the emulator, which refuses what the library refuses."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
from pathlib import Path
from typing import Any

import flash_helpers as h
import pytest
import torch
from attnhub_flash import (
    FlashFA3Backend,
    FlashFA4Backend,
    FlashVllmFA3Backend,
    emulator,
    ops,
    providers,
)
from attnhub_flash.emulator import FlashOpError

from attnhub.errors import UnsupportedConfigurationError

H, HK = 2, 1


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _paged(kv_lens: list[int], page: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random paged cache holding ``kv_lens`` keys per sequence, and its int32 table."""
    blocks = [max(1, -(-n // page)) for n in kv_lens]
    cache = torch.randn(sum(blocks), page, HK, head).to(torch.bfloat16)
    table = torch.zeros(len(kv_lens), max(blocks), dtype=torch.int32)
    nxt = 0
    for b, count in enumerate(blocks):
        table[b, :count] = torch.arange(nxt, nxt + count)
        nxt += count
    return cache, table


def _fork(
    q_lens: list[int], kv_lens: list[int], *, fa_version: int, head: int = 64, **kw: Any
) -> Any:
    cache, table = _paged(kv_lens, 16, head)
    args: dict[str, Any] = dict(
        q=torch.randn(sum(q_lens), H, head).to(torch.bfloat16),
        k=cache,
        v=cache,
        cu_seqlens_q=_cu(q_lens),
        max_seqlen_q=max(q_lens),
        seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
        max_seqlen_k=max(kv_lens),
        block_table=table,
        causal=True,
        return_softmax_lse=True,
        fa_version=fa_version,
    )
    args.update(kw)
    return emulator.VLLM.flash_attn_varlen_func(**args)


def _fa4(head: int, page: int, *, causal: bool = True, window: Any = (None, None)) -> Any:
    cache, table = _paged([5], page, head)
    return emulator.FA4.flash_attn_varlen_func(
        torch.randn(2, H, head).to(torch.bfloat16),
        cache,
        cache,
        cu_seqlens_q=_cu([2]),
        seqused_k=torch.tensor([5], dtype=torch.int32),
        page_table=table,
        causal=causal,
        window_size=window,
    )


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A pretend CUDA machine: every provider's modules 'import' (fakes), torch sees a GPU of
    the compute capability the test sets (``gpu(major, minor)``), and the vLLM fork's
    ``fa_version_unsupported_reason`` is the test's ``gpu.probe``."""
    state: dict[str, Any] = {"capability": (9, 0)}
    modules = {
        module: types.SimpleNamespace(**dict.fromkeys(functions, print))
        for module, functions in ops.FUNCTIONS.items()
    }
    fork = modules["vllm.vllm_flash_attn"]
    fork.fa_version_unsupported_reason = lambda fa_version: None
    monkeypatch.setattr(ops, "import_once", lambda module: (modules[module], None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["capability"])
    monkeypatch.delenv("FLASH_ATTENTION_ARCH", raising=False)

    def set_capability(major: int, minor: int = 0) -> None:
        state["capability"] = (major, minor)

    set_capability.fork = fork  # type: ignore[attr-defined]
    return set_capability


# --- 12: vllm-fa3's availability asks vLLM 0.32's one-argument probe --------------------------


def test_a_module_without_the_providers_functions_is_not_the_provider(gpu: Any) -> None:
    # flash-attn-4 alone: flash_attn is a namespace package holding only cute/
    del ops.import_once("flash_attn")[0].flash_attn_varlen_func
    why = h.BACKENDS["fa2"].availability("cuda:0")
    assert why is not None and "no flash_attn_varlen_func" in why and "flash-attn" in why
    assert h.BACKENDS["fa4"].availability("cuda:0") is None


def test_vllm_fa3_availability_calls_vllm_032s_one_argument_probe(gpu: Any) -> None:
    asked: list[int] = []

    def fa_version_unsupported_reason(fa_version: int) -> str | None:  # vLLM 0.32's def
        asked.append(fa_version)
        return None

    gpu.fork.fa_version_unsupported_reason = fa_version_unsupported_reason
    assert FlashVllmFA3Backend.availability("cuda:0") is None
    assert asked == [3]


def test_vllm_fa3_availability_passes_the_device_where_the_fork_takes_it(gpu: Any) -> None:
    asked: list[tuple[int, object]] = []

    def fa_version_unsupported_reason(fa_version: int, device: Any = None) -> str | None:
        asked.append((fa_version, device))
        return "FA3 is only supported on devices with compute capability 9.x"

    gpu.fork.fa_version_unsupported_reason = fa_version_unsupported_reason
    why = FlashVllmFA3Backend.availability("cuda:0")
    assert asked == [(3, torch.device("cuda:0"))]
    assert why is not None and "compute capability 9.x" in why and "vllm-fa3" in why


def test_whatever_the_forks_probe_raises_is_a_reason_not_an_error(gpu: Any) -> None:
    def fa_version_unsupported_reason(fa_version: int) -> str | None:
        raise RuntimeError("CUDA driver initialization failed")

    gpu.fork.fa_version_unsupported_reason = fa_version_unsupported_reason
    why = FlashVllmFA3Backend.availability("cuda:0")
    assert why is not None and "RuntimeError" in why and "driver initialization" in why


def test_the_install_probe_imports_nothing_and_survives_a_package_that_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a flash_attn whose __init__ fails as a CUDA build without its driver does
    pkg = tmp_path / "flash_attn"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('libcudart.so.12: cannot open')\n")
    (pkg / "cute" / "__init__.py").write_text("")
    (tmp_path / "flash_attn_interface.py").write_text("raise OSError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert ops.module_exists("flash_attn.cute") and ops.module_exists("flash_attn_interface")
    assert not ops.module_exists("flash_attn.missing")
    assert "flash_attn" not in sys.modules and "flash_attn_interface" not in sys.modules
    assert providers.chosen_provider() == "fa4"  # the first of PREFERENCE installed

    def broken(name: str, package: str | None = None) -> None:
        raise RuntimeError("a finder that breaks")

    monkeypatch.setattr(ops.importlib.util, "find_spec", broken)
    assert not ops.module_exists("flash_attn.cute")
    assert providers.chosen_provider() == providers.DEFAULT


# --- 13: s_aux to the fork's FA3 is bf16, contiguous, at most 64 query heads -------------------


def test_vllm_fa3_refuses_sinks_with_more_than_64_query_heads() -> None:
    spec = h.spec("vllm-fa3", num_heads=72, num_kv_heads=8, use_sinks=True)
    reasons = FlashVllmFA3Backend.unsupported_reasons(spec)
    assert any("64" in r and "S aux" in r and r.field == "num_heads" for r in reasons), reasons
    assert not FlashVllmFA3Backend.unsupported_reasons(dataclasses.replace(spec, use_sinks=False))
    assert not FlashFA4Backend.unsupported_reasons(h.spec("fa4", num_heads=72, use_sinks=True))


def test_vllm_fa3_runs_sinks_with_bf16_models_only() -> None:
    # s_aux is read in bf16 only; vLLM passes sinks in the model's dtype
    fp16 = h.spec("vllm-fa3", dtype=torch.float16, use_sinks=True)
    reasons = FlashVllmFA3Backend.unsupported_reasons(fp16)
    assert any("bf16 dtype for S aux" in r and r.field == "dtype" for r in reasons), reasons
    assert not FlashVllmFA3Backend.unsupported_reasons(dataclasses.replace(fp16, use_sinks=False))
    assert not FlashVllmFA3Backend.unsupported_reasons(h.spec("vllm-fa3", use_sinks=True))


def test_the_forks_fa3_takes_s_aux_as_its_flash_api_checks_it() -> None:
    sinks = torch.tensor([0.5, -1.0])
    _, lse = _fork([1], [5], fa_version=3, s_aux=sinks.bfloat16())
    assert torch.isfinite(lse).all()
    with pytest.raises(FlashOpError, match="bf16 dtype for S aux"):
        _fork([1], [5], fa_version=3, s_aux=sinks)
    strided = torch.zeros(4, dtype=torch.bfloat16)[::2]
    with pytest.raises(FlashOpError, match="s_aux must be contiguous"):
        _fork([1], [5], fa_version=3, s_aux=strided)
    with pytest.raises(FlashOpError, match="query heads <= 64 with S aux"):
        _fork(
            [1],
            [5],
            fa_version=3,
            q=torch.zeros(1, 72, 64, dtype=torch.bfloat16),
            s_aux=torch.zeros(72, dtype=torch.bfloat16),
        )


# --- 14, 15 and 16 (FA4): head sizes and page sizes per architecture ------------------------------


def test_fa4_refuses_irregular_head_sizes_paged_off_its_key_tile() -> None:
    # SM100 (no GPU: FA4's emulated architecture): tile_n 128
    reasons = FlashFA4Backend.unsupported_reasons(h.spec("fa4", head_size=72, block_size=16))
    assert any("irregular head dim" in r and r.field == "block_size" for r in reasons), reasons
    assert not FlashFA4Backend.unsupported_reasons(h.spec("fa4", head_size=72, block_size=128))
    assert not FlashFA4Backend.unsupported_reasons(h.spec("fa4", head_size=80, block_size=16))
    with pytest.raises(AssertionError, match="Paged KV does not support irregular head dim"):
        _fa4(72, 16)
    assert _fa4(72, 128)[0].shape == (2, H, 72)
    assert _fa4(80, 16)[0].shape == (2, H, 80)


def test_fa4_on_sm90_takes_head_sizes_up_to_256_with_its_own_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_90a")
    refused = FlashFA4Backend.unsupported_reasons
    assert not refused(h.spec("fa4", head_size=160, block_size=16))
    assert not refused(h.spec("fa4", head_size=136, block_size=112))  # SM90's tile for 136
    assert refused(h.spec("fa4", head_size=136, block_size=128))
    assert not refused(h.spec("fa4", head_size=136, block_size=96, sliding_window=64))
    # 65..96: the tile is 128 causal, 144 not: a spec that may run either is refused ...
    assert refused(h.spec("fa4", head_size=72, block_size=128))
    # ... unless a window makes every call local
    assert not refused(h.spec("fa4", head_size=72, block_size=128, sliding_window=64))
    assert _fa4(160, 16)[0].shape == (2, H, 160)
    assert _fa4(136, 112)[0].shape == (2, H, 136)
    assert _fa4(72, 128, causal=True)[0].shape == (2, H, 72)
    with pytest.raises(AssertionError, match="irregular head dim"):
        _fa4(72, 128, causal=False)  # non-causal: tile 144
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_100a")
    assert any("SM100" in r for r in refused(h.spec("fa4", head_size=160, block_size=16)))
    with pytest.raises(FlashOpError, match=r"8\.\.128"):
        _fa4(160, 16)


def test_fa4_with_paged_kv_is_unavailable_on_sm12(
    gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu(12, 0)
    why = FlashFA4Backend.availability("cuda:0")
    assert why is not None and "12.0" in why and "Paged KV not supported on SM 12.0" in why
    gpu(10, 0)
    assert FlashFA4Backend.availability("cuda:0") is None
    monkeypatch.setenv("FLASH_ATTENTION_ARCH", "sm_120")
    with pytest.raises(AssertionError, match=r"Paged KV not supported on SM 12\.0"):
        _fa4(64, 128)


# --- 16: the smaller points -------------------------------------------------------------------


def test_an_empty_row_has_lse_plus_inf_on_fa2_and_minus_inf_on_fa3() -> None:
    # q_len 4 over 2 keys, causal: rows 0 and 1 see nothing
    for fa_version, empty in ((2, math.inf), (3, -math.inf)):
        out, lse = _fork([4], [2], fa_version=fa_version)
        assert torch.all(out[:2] == 0) and torch.all(lse[:, :2] == empty), fa_version
        assert torch.isfinite(lse[:, 2:]).all()
    cache, table = _paged([2], 16, 64)
    out, lse, *_ = emulator.FA3.flash_attn_with_kvcache(
        torch.randn(4, H, 64).to(torch.bfloat16),
        cache,
        cache,
        cache_seqlens=torch.tensor([2], dtype=torch.int32),
        page_table=table,
        cu_seqlens_q=_cu([4]),
        max_seqlen_q=4,
        causal=True,
        return_softmax_lse=True,
    )
    assert torch.all(lse[:, :2] == -math.inf) and torch.all(out[:2] == 0)


def test_the_forks_fa3_drops_the_sink_of_a_sequence_without_keys() -> None:
    sinks = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    # sequence 0 has no key (store_zero: -inf, no sink); sequence 1 a key-less row inside a
    # sequence with keys (finalize_aux: the sink alone, LSE = the sink)
    out, lse = _fork([1, 3], [0, 2], fa_version=3, s_aux=sinks)
    assert torch.all(out[0] == 0) and torch.all(lse[:, 0] == -math.inf)
    assert torch.all(out[1] == 0) and torch.allclose(lse[:, 1], sinks.float())
    assert torch.isfinite(lse[:, 2:]).all()


def test_fa2_takes_any_multiple_of_256_as_its_page_size() -> None:
    assert not h.BACKENDS["fa2"].unsupported_reasons(h.spec("fa2", block_size=768))
    assert h.BACKENDS["fa2"].unsupported_reasons(h.spec("fa2", block_size=384))
    st = h.step([(3, 900), (1, 20)], "fa2", h.spec("fa2", block_size=768))
    h.assert_matches_reference(st, h.forward(st))


def test_fa3_runs_fp16_and_bf16_on_sm8x_and_fp8_only_on_9x(gpu: Any) -> None:
    gpu(8, 6)
    assert FlashFA3Backend.availability("cuda:0") is None
    assert FlashFA3Backend(h.spec("fa3"), "cuda:0").ops.provider == "fa3"
    with pytest.raises(UnsupportedConfigurationError, match=r"compute capability 9\.x"):
        FlashFA3Backend(h.spec("fa3", kv_cache_dtype="fp8_e4m3"), "cuda:0")
    gpu(9, 0)
    assert FlashFA3Backend(h.spec("fa3", kv_cache_dtype="fp8_e4m3"), "cuda:0").ops.provider
    gpu(10, 0)
    assert "sm_90a" in (FlashFA3Backend.availability("cuda:0") or "")


def test_fa2_return_attn_probs_gives_an_empty_s_dmask_not_none() -> None:
    cache, table = _paged([300], 256, 64)
    result = emulator.FA2.flash_attn_varlen_func(
        torch.randn(2, H, 64).to(torch.bfloat16),
        cache,
        cache,
        _cu([2]),
        _cu([300]),
        2,
        300,
        block_table=table,
        return_attn_probs=True,
    )
    assert len(result) == 3 and isinstance(result[2], torch.Tensor)
    assert result[2].numel() == 0 and result[2].dtype == torch.bfloat16


# --- issue 23: integer metadata as FlashAttention checks it -----------------------------------


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a strided view (every other entry of a bigger buffer)."""
    buf = torch.full((2 * t.numel(),), -7, dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_strided_slot_mapping_is_written_where_it_says(provider: str) -> None:
    st = h.step([(3, 40), (1, 9)], provider, padding=2)
    batch = st.batch
    slots = _strided(batch.slot_mapping)
    assert not slots.is_contiguous()
    st.batch = dataclasses.replace(batch, slot_mapping=slots, slot_mapping_cpu=slots.clone())
    with emulator.record_calls() as calls:
        out = h.forward(st)
    h.assert_matches_reference(st, out)
    for c in calls:  # the KV write op gets a dense int64 slot mapping
        if c.name == "vllm._custom_ops.reshape_and_cache_flash":
            assert c.args[4].is_contiguous() and c.args[4].dtype == torch.int64
    # positional write_kv with the same strided view
    fresh = st.backend.allocate_kv_cache(st.cache.num_blocks)
    impl = st.backend.impl(sinks=st.sinks, alibi_slopes=st.alibi)
    impl.write_kv(st.key, st.value, fresh, slots)
    rows = batch.slot_mapping >= 0
    flat = fresh.key.reshape(-1, *fresh.key.shape[2:])
    assert torch.equal(flat[batch.slot_mapping[rows]], st.key[: rows.numel()][rows])


def test_the_kv_write_refuses_a_strided_slot_mapping_it_would_misread() -> None:
    kc = torch.zeros(2, 16, HK, 64, dtype=torch.bfloat16)
    key = torch.ones(2, HK, 64, dtype=torch.bfloat16)
    one = torch.ones(1)
    with pytest.raises(FlashOpError, match="slot_mapping must be contiguous"):
        emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(
            key, key, kc, kc.clone(), _strided(torch.tensor([0, 5])), "auto", one, one
        )
    emulator.VLLM_CACHE_OPS.reshape_and_cache_flash(  # one slot: contiguous at any stride
        key, key, kc, kc.clone(), _strided(torch.tensor([3])), "auto", one, one
    )


@pytest.mark.parametrize("provider", h.PROVIDERS)
def test_a_one_request_step_with_a_stride_2_seq_lens_runs_as_flashattention_takes_it(
    provider: str,
) -> None:
    st = h.step([(2, 30)], provider)
    seq_lens = _strided(st.batch.seq_lens)
    assert seq_lens.stride() == (2,) and seq_lens.is_contiguous()  # one element
    st.batch = dataclasses.replace(st.batch, seq_lens=seq_lens)
    h.assert_matches_reference(st, h.forward(st))


def test_length_tensors_are_checked_with_is_contiguous() -> None:
    cache, table = _paged([5], 16, 64)
    call = dict(
        k_cache=cache,
        v_cache=cache,
        page_table=table,
        cu_seqlens_q=_cu([2]),
        max_seqlen_q=2,
        causal=True,
    )
    q = torch.randn(2, H, 64).to(torch.bfloat16)
    one = _strided(torch.tensor([5], dtype=torch.int32))
    assert emulator.FA3.flash_attn_with_kvcache(q, cache_seqlens=one, **call).shape == q.shape
    two, table2 = _strided(torch.tensor([5, 5], dtype=torch.int32)), torch.cat([table, table])
    with pytest.raises(FlashOpError, match="cache_seqlens must be contiguous"):
        emulator.FA3.flash_attn_with_kvcache(
            torch.cat([q, q]),
            cache_seqlens=two,
            **{**call, "page_table": table2, "cu_seqlens_q": _cu([2, 2])},
        )


@pytest.mark.parametrize("provider", h.PROVIDERS)
@pytest.mark.parametrize("name", ["query_start_loc", "seq_lens", "block_table", "slot_mapping"])
def test_strided_integer_metadata_reaches_no_kernel_and_no_write_is_half_done(
    provider: str, name: str
) -> None:
    st = h.step([(3, 40), (1, 9), (2, 2)], provider, padding=1)
    value = getattr(st.batch, name)
    if value.dim() == 1:
        strided = _strided(value)
    else:  # every other column of a wider table
        strided = torch.full((value.shape[0], 2 * value.shape[1]), -7, dtype=value.dtype)[:, ::2]
        strided.copy_(value)
    assert torch.equal(strided, value) and not strided.is_contiguous()
    st.batch = dataclasses.replace(st.batch, **{name: strided})
    before = (st.cache.key.clone(), st.cache.value.clone())
    try:
        out = h.forward(st)
    except FlashOpError as exc:  # an untyped refusal, and where it came
        changed = not (
            torch.equal(before[0], st.cache.key) and torch.equal(before[1], st.cache.value)
        )
        pytest.fail(f"{name}: {exc} (cache changed: {changed})")
    h.assert_matches_reference(st, out)
