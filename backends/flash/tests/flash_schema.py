"""Reading FlashAttention's published Python interfaces without importing (or building) them.

Sources, downloaded once into ``$ATTNHUB_WHEEL_CACHE`` (default ``~/.cache/attnhub/wheels``,
shared with the ascend contract):
  - the ``flash-attn==2.8.3`` sdist: ``flash_attn/flash_attn_interface.py`` (FA2) and
    ``hopper/flash_attn_interface.py`` (FA3). Its setup.py imports torch even for metadata, so
    it is fetched with ``FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE pip download --no-deps
    --no-binary :all: --no-build-isolation`` (torch installed, no CUDA needed);
  - the ``flash-attn-4==4.0.0b36`` wheel (pure Python): ``flash_attn/cute/interface.py``.
A function's parameters are read with ``ast`` (nothing is executed) as (name, kind, default),
defaults resolved through the module's own constants (``fa_version=DEFAULT_FA_VERSION``).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

NO_DEFAULT = inspect.Parameter.empty


@dataclass(frozen=True)
class Archive:
    requirement: str
    glob: str
    pip_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


FA_SDIST = Archive(
    "flash-attn==2.8.3",
    "flash_attn-2.8.3.tar.gz",
    ("--no-binary", ":all:", "--no-build-isolation"),
    (("FLASH_ATTENTION_SKIP_CUDA_BUILD", "TRUE"),),
)
FA4_WHEEL = Archive(
    "flash-attn-4==4.0.0b36", "flash_attn_4-4.0.0b36-*.whl", ("--only-binary", ":all:")
)


@dataclass(frozen=True)
class Param:
    name: str
    kw_only: bool
    default: object = NO_DEFAULT

    def describe(self) -> str:
        kind = "keyword-only" if self.kw_only else "positional-or-keyword"
        d = "" if self.default is NO_DEFAULT else f"={self.default!r}"
        return f"{kind} {self.name}{d}"


def cache_dir() -> Path:
    return Path(
        os.environ.get("ATTNHUB_WHEEL_CACHE") or Path.home() / ".cache" / "attnhub" / "wheels"
    )


def find_or_download(archive: Archive) -> tuple[Path | None, str]:
    """The cached archive, downloading it once if needed: (path, "") or (None, why not)."""
    directory = cache_dir()
    found = sorted(directory.glob(archive.glob))
    if found:
        return found[0], ""
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *archive.pip_args,
        archive.requirement,
        "-d",
        str(directory),
    ]
    env = {**os.environ, **dict(archive.env)}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=900, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(cmd)} could not run: {exc}"
    found = sorted(directory.glob(archive.glob))
    if proc.returncode or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"{' '.join(cmd)} failed (exit {proc.returncode}): {' | '.join(tail)}"
    return found[0], ""


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


def from_signature(sig: inspect.Signature) -> tuple[Param, ...]:
    return tuple(
        Param(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )


def differences(want: tuple[Param, ...], got: tuple[Param, ...]) -> list[str]:
    """Every way ``got`` (the emulator) differs from ``want`` (the published function)."""
    problems = []
    w = {p.name: p for p in want}
    g = {p.name: p for p in got}
    for name in w.keys() - g.keys():
        problems.append(f"missing parameter: {w[name].describe()}")
    for name in g.keys() - w.keys():
        problems.append(f"parameter not in the interface: {g[name].describe()}")
    for name in w.keys() & g.keys():
        a, b = w[name], g[name]
        if a.kw_only != b.kw_only:
            problems.append(f"{name}: interface has it {a.describe()}, emulator {b.describe()}")
        elif not _same_default(a.default, b.default):
            problems.append(f"{name}: interface default {a.default!r}, emulator {b.default!r}")
    order_w = [p.name for p in want if not p.kw_only]
    order_g = [p.name for p in got if not p.kw_only]
    if not problems and order_w != order_g:
        problems.append(f"positional order: interface {order_w}, emulator {order_g}")
    return problems


def _same_default(a: object, b: object) -> bool:
    if a is NO_DEFAULT or b is NO_DEFAULT:
        return a is b
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_default(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) and not isinstance(b, str):  # an expression kept as text, e.g.
        return a == repr(b)  # `torch.bfloat16`: the emulator's object must spell the same
    return a == b
