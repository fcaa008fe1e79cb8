"""Contract checks of an emulator against a vendor's published signatures, for backend tests.

A vendor backend's emulator must take exactly the arguments the vendor's functions take. Where
the vendor publishes them (a schema file in a wheel, an interface module in an sdist), a
contract test reads that artifact, cached once, and compares parameters with the emulator's
``inspect.signature``. This module holds the parts every such test shares:

- :class:`VendorArtifact` and :func:`find_or_download`: a wheel or sdist fetched once with
  ``pip download --no-deps`` into ``$ATTNHUB_WHEEL_CACHE`` (default ``~/.cache/attnhub/wheels``);
  a download that fails returns the reason, for the test to skip with (never a pass); an
  artifact pinned by ``sha256`` (and ``min_bytes``) is checked, cached or fresh, and a file
  that does not match is an error (:class:`ArtifactMismatchError`), never a skip;
- :class:`Param`, :func:`params_of` and :func:`differences`: parameters compared by name,
  kind (positional or keyword-only), default and positional order, each difference a sentence.

How a vendor's own format is parsed (a YAML of schema strings, a Python module read with
``ast``) stays with that backend's tests.

This is test tooling, not runtime: it shells out to ``pip``, so it lives in the conformance
distribution (every backend's ``test`` extra installs it), never in the core ``attnhub``, whose
import loads no pip machinery.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: A parameter without a default (required).
NO_DEFAULT = inspect.Parameter.empty


@dataclass(frozen=True)
class VendorArtifact:
    """A published file to read signatures from: ``pip download --no-deps [pip_args]
    requirement``, found in the cache by ``glob``; ``env``: extra environment for pip."""

    requirement: str  # "flash-attn==2.8.3"
    glob: str  # "flash_attn-2.8.3.tar.gz"
    pip_args: tuple[str, ...] = ("--only-binary", ":all:")
    env: tuple[tuple[str, str], ...] = ()
    timeout_s: int = 900
    #: The file's SHA-256 (hex) where it is pinned: what was read when the contract was written.
    sha256: str | None = None
    #: A lower bound of its size: a truncated or placeholder file is refused before hashing.
    min_bytes: int = 0


class ArtifactMismatchError(AssertionError):
    """A cached or downloaded artifact is not the pinned file (its hash or size differs): the
    contract would read something else than what it was written against."""


def check_artifact(artifact: VendorArtifact, path: Path) -> None:
    """Raise ArtifactMismatchError naming the file when it is smaller than ``min_bytes`` or
    its SHA-256 is not the pinned one."""
    size = path.stat().st_size
    if size < artifact.min_bytes:
        raise ArtifactMismatchError(
            f"{path} has {size} bytes; {artifact.requirement} has at least {artifact.min_bytes}"
        )
    if artifact.sha256 is None:
        return
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != artifact.sha256.lower():
        raise ArtifactMismatchError(
            f"{path}: sha256 {digest.hexdigest()}, pinned {artifact.sha256} for "
            f"{artifact.requirement} (delete it to download again, or re-pin after reading "
            "the new file's interface)"
        )


def artifact_cache_dir() -> Path:
    return Path(
        os.environ.get("ATTNHUB_WHEEL_CACHE") or Path.home() / ".cache" / "attnhub" / "wheels"
    )


def find_or_download(artifact: VendorArtifact) -> tuple[Path | None, str]:
    """The cached artifact, downloading it once if needed: ``(path, "")`` or ``(None, why
    not)`` (the command, its exit status and the last lines it printed). A file that is not
    the pinned one raises ArtifactMismatchError (:func:`check_artifact`)."""
    directory = artifact_cache_dir()
    found = sorted(directory.glob(artifact.glob))
    if found:
        check_artifact(artifact, found[0])
        return found[0], ""
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        *artifact.pip_args,
        artifact.requirement,
        "-d",
        str(directory),
    ]
    env = {**os.environ, **dict(artifact.env)}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=artifact.timeout_s, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(cmd)} could not run: {exc}"
    found = sorted(directory.glob(artifact.glob))
    if proc.returncode or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"{' '.join(cmd)} failed (exit {proc.returncode}): {' | '.join(tail)}"
    check_artifact(artifact, found[0])
    return found[0], ""


@dataclass(frozen=True)
class Param:
    """One parameter of a function, as a contract compares it."""

    name: str
    kw_only: bool
    default: object = NO_DEFAULT  # NO_DEFAULT: required
    is_out: bool = False  # a schema's out argument (``Tensor(a!)`` in an out overload)

    def describe(self) -> str:
        kind = "keyword-only" if self.kw_only else "positional"
        d = "" if self.default is NO_DEFAULT else f"={self.default!r}"
        return f"{kind} {self.name}{d}"


def params_of(sig: inspect.Signature) -> tuple[Param, ...]:
    """An emulator function's parameters (``*args`` / ``**kwargs`` are not parameters)."""
    return tuple(
        Param(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )


def differences(
    want: tuple[Param, ...], got: tuple[Param, ...], *, source: str = "the schema"
) -> list[str]:
    """Every way ``got`` (the emulator) differs from ``want`` (what ``source`` publishes), as
    sentences; empty when they agree."""
    problems = []
    w = {p.name: p for p in want}
    g = {p.name: p for p in got}
    for name in w.keys() - g.keys():
        problems.append(f"missing parameter: {w[name].describe()}")
    for name in g.keys() - w.keys():
        problems.append(f"parameter not in {source}: {g[name].describe()}")
    for name in w.keys() & g.keys():
        a, b = w[name], g[name]
        if a.kw_only != b.kw_only:
            problems.append(f"{name}: {source} has it {a.describe()}, emulator {b.describe()}")
        elif not same_default(a.default, b.default):
            problems.append(f"{name}: {source} default {a.default!r}, emulator {b.default!r}")
    order_w = [p.name for p in want if not p.kw_only]
    order_g = [p.name for p in got if not p.kw_only]
    if not problems and order_w != order_g:
        problems.append(f"positional order: {source} {order_w}, emulator {order_g}")
    return problems


def same_default(a: object, b: object) -> bool:
    """Whether two defaults are the same value: numbers by value (1 == 1.0), bools and None by
    identity, sequences element-wise; a published default kept as the text of an expression
    (``"torch.bfloat16"``) equals an object whose repr spells it."""
    if a is NO_DEFAULT or b is NO_DEFAULT:
        return a is b
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_default(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str) and not isinstance(b, str):
        return a == repr(b)
    return a == b
