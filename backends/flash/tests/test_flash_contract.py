"""The emulator's function signatures match the published FlashAttention interfaces (the
``contracts`` check).

Read with ``ast`` from the ``flash-attn==2.8.3`` sdist (FA2 and hopper FA3) and the
``flash-attn-4==4.0.0b36`` wheel (FA4), downloaded once (see ``flash_schema``): names,
positional order, keyword-only split and defaults. A download that fails skips, saying why.
vLLM's fork has no separately published package: its two functions are checked against the
signatures recorded below from its sources, with where they come from.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import flash_schema
import pytest
from attnhub_flash import emulator

pytestmark = pytest.mark.contract

#: emulated function -> (archive, member path, function name in that file)
PUBLISHED = {
    "flash_attn.flash_attn_varlen_func": (
        flash_schema.FA_SDIST,
        "flash_attn/flash_attn_interface.py",
        "flash_attn_varlen_func",
    ),
    "flash_attn.flash_attn_with_kvcache": (
        flash_schema.FA_SDIST,
        "flash_attn/flash_attn_interface.py",
        "flash_attn_with_kvcache",
    ),
    "flash_attn_interface.flash_attn_with_kvcache": (
        flash_schema.FA_SDIST,
        "hopper/flash_attn_interface.py",
        "flash_attn_with_kvcache",
    ),
    "flash_attn.cute.flash_attn_varlen_func": (
        flash_schema.FA4_WHEEL,
        "flash_attn/cute/interface.py",
        "flash_attn_varlen_func",
    ),
}

#: vLLM's functions, recorded (no published archive to download): the def lines as they stand
#: in vllm-project/flash-attention@03ef28b388dc7f2c0c5fe8166dff4f98f07491dc
#: (vllm_flash_attn/flash_attn_interface.py) and vllm-project/vllm vllm/_custom_ops.py.
RECORDED = {
    "vllm.vllm_flash_attn.flash_attn_varlen_func": """
DEFAULT_FA_VERSION = 2
def flash_attn_varlen_func(
    q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
    q_v=None, dropout_p=0.0, softmax_scale=None, causal=False,
    window_size: Optional[List[int]] = None, softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False, block_table=None, return_softmax_lse=False,
    out=None, scheduler_metadata=None, q_descale=None, k_descale=None, v_descale=None,
    num_splits: int = 0, fa_version: int = DEFAULT_FA_VERSION, s_aux=None, cp_world_size=1,
    cp_rank=0, cp_tot_seqused_k=None,
): ...
""",
    "vllm.vllm_flash_attn.get_scheduler_metadata": """
def get_scheduler_metadata(
    batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
    cache_seqlens: torch.Tensor, qkv_dtype=torch.bfloat16, headdim_v=None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None, page_size: Optional[int] = None,
    max_seqlen_k_new=0, causal=False, window_size=(-1, -1), has_softcap=False, num_splits=0,
    pack_gqa=None, sm_margin=0,
): ...
""",
    "vllm._custom_ops.reshape_and_cache_flash": """
def reshape_and_cache_flash(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str,
    k_scale: torch.Tensor, v_scale: torch.Tensor,
) -> None: ...
""",
}


def test_every_emulated_function_has_a_published_or_recorded_signature() -> None:
    assert set(emulator.FUNCTIONS) == set(PUBLISHED) | set(RECORDED)


_archives: dict[str, Path] = {}


def _archive(archive: flash_schema.VendorArtifact) -> Path:
    if archive.requirement not in _archives:
        path, why = flash_schema.find_or_download(archive)
        if path is None:
            pytest.skip(f"cannot download {archive.requirement} for the contract: {why}")
        _archives[archive.requirement] = path
    return _archives[archive.requirement]


def _check(name: str, want: tuple[flash_schema.Param, ...], source: str) -> None:
    got = flash_schema.from_signature(inspect.signature(emulator.FUNCTIONS[name]))
    problems = flash_schema.differences(want, got)
    assert not problems, f"emulated {name} differs from {source}:\n  - " + "\n  - ".join(problems)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_emulated_signature_matches_the_published_interface(name: str) -> None:
    archive, member, function = PUBLISHED[name]
    path = _archive(archive)
    want = flash_schema.function_params(flash_schema.read_member(path, member), function)
    _check(name, want, f"{path.name}:{member}")


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_emulated_signature_matches_vllms_recorded_one(name: str) -> None:
    function = name.rsplit(".", 1)[1]
    _check(name, flash_schema.function_params(RECORDED[name], function), "the recorded def")


def test_the_reader_resolves_module_constants_and_keyword_only_parameters() -> None:
    src = "X = 3\ndef f(a, b=X, *, c=(None, None), d): ...\n"
    P = flash_schema.Param
    assert flash_schema.function_params(src, "f") == (
        P("a", False),
        P("b", False, 3),
        P("c", True, (None, None)),
        P("d", True),
    )


def test_a_renamed_or_reordered_parameter_is_reported() -> None:
    want = flash_schema.function_params("def f(q, k, block_table=None): ...", "f")
    renamed = flash_schema.function_params("def f(q, k, page_table=None): ...", "f")
    problems = flash_schema.differences(want, renamed)
    assert any("missing parameter" in p and "block_table" in p for p in problems)
    assert any("not in the interface" in p and "page_table" in p for p in problems)
    swapped = flash_schema.function_params("def f(k, q, block_table=None): ...", "f")
    assert any("positional order" in p for p in flash_schema.differences(want, swapped))
    window = flash_schema.function_params("def f(q, k, block_table=(-1, -1)): ...", "f")
    assert any("default" in p for p in flash_schema.differences(want, window))
