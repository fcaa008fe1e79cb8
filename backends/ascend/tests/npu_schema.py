"""Reading torch_npu's published op schemas out of its wheel, without importing torch_npu.

Two sources, both inside the wheel (``pip download --no-deps torch-npu==2.10.0.post4``):
  - ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``: the native-functions YAML of
    every op torch_npu's codegen registers (``func: name.overload(args) -> returns`` lines);
  - ``torch_npu/lib/libop_plugin_atb.so``: the ATB op plugin, which registers its ops
    (``_npu_reshape_and_cache``, ``_npu_paged_attention``, ...) from schema strings compiled
    into the library; they are absent from the YAML.
A schema string is parsed into parameters (name, keyword-only, default) comparable with a
Python ``inspect.Signature``.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

WHEEL_REQUIREMENT = "torch-npu==2.10.0.post4"
WHEEL_GLOB = "torch_npu-2.10.0.post4-*.whl"
YAML_PATH = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
ATB_LIBRARY = "torch_npu/lib/libop_plugin_atb.so"
NO_DEFAULT = inspect.Parameter.empty


@dataclass(frozen=True)
class Param:
    name: str
    kw_only: bool
    default: object = NO_DEFAULT  # NO_DEFAULT: required
    is_out: bool = False  # an out argument (``Tensor(a!)`` after ``*`` in an out overload)

    def describe(self) -> str:
        kind = "keyword-only" if self.kw_only else "positional"
        d = "" if self.default is NO_DEFAULT else f"={self.default!r}"
        return f"{kind} {self.name}{d}"


@dataclass(frozen=True)
class Schema:
    name: str  # "npu_fused_infer_attention_score" or "npu_fused_infer_attention_score.out"
    params: tuple[Param, ...]
    text: str


def cache_dir() -> Path:
    return Path(
        os.environ.get("ATTNHUB_WHEEL_CACHE") or Path.home() / ".cache" / "attnhub" / "wheels"
    )


def find_or_download_wheel() -> tuple[Path | None, str]:
    """The cached wheel, downloading it once if needed: (path, "") or (None, why not)."""
    directory = cache_dir()
    found = sorted(directory.glob(WHEEL_GLOB))
    if found:
        return found[0], ""
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        WHEEL_REQUIREMENT,
        "-d",
        str(directory),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{' '.join(cmd)} could not run: {exc}"
    found = sorted(directory.glob(WHEEL_GLOB))
    if proc.returncode or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return None, f"{' '.join(cmd)} failed (exit {proc.returncode}): {' | '.join(tail)}"
    return found[0], ""


def yaml_schemas(wheel: Path) -> dict[str, list[Schema]]:
    """Every ``func:`` line of the codegen YAML, by op name (with overload); an op may be listed
    in several sections of the YAML."""
    with zipfile.ZipFile(wheel) as z:
        text = z.read(YAML_PATH).decode()
    out: dict[str, list[Schema]] = {}
    for m in re.finditer(r"^\s*(?:-\s*)?func:\s*(.+?)\s*$", text, re.MULTILINE):
        if "(" not in m.group(1):
            continue  # a bare name (the "supported" section lists aten ops by name only)
        schema = parse(m.group(1))
        out.setdefault(schema.name, []).append(schema)
    return out


def atb_schema(wheel: Path, name: str) -> Schema | None:
    """The registration string of ATB op ``name`` compiled into the ATB plugin library."""
    with zipfile.ZipFile(wheel) as z:
        data = z.read(ATB_LIBRARY)
    m = re.search(re.escape(name).encode() + rb"\([^\x00]*?\)\s*->\s*[^\x00]*", data)
    return parse(m.group(0).decode()) if m else None


def _split_top_level(s: str) -> list[str]:
    """Split on commas outside brackets, parentheses and quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in s:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _default(text: str) -> object:
    text = text.strip()
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text[:1] in "\"'" and text[-1:] == text[:1]:
        return text[1:-1]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text  # e.g. a list literal; compared as text


def parse(func: str) -> Schema:
    """``name.overload(Type arg=default, *, ...) -> returns`` into a Schema."""
    m = re.match(r"\s*([\w.]+)\s*\((.*)\)\s*->", func, re.DOTALL)
    if m is None:
        raise ValueError(f"not a schema: {func!r}")
    name, body = m.group(1), m.group(2)
    params = []
    kw_only = False
    for arg in _split_top_level(body):
        if arg == "*":
            kw_only = True
            continue
        decl, _, default = arg.partition("=")
        type_, _, pname = decl.strip().rpartition(" ")
        params.append(
            Param(
                name=pname,
                kw_only=kw_only,
                default=_default(default) if default else NO_DEFAULT,
                is_out="!" in type_ and name.endswith(".out"),
            )
        )
    return Schema(name, tuple(params), func)


def from_signature(sig: inspect.Signature) -> tuple[Param, ...]:
    return tuple(
        Param(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    )


def expected_python_params(schema: Schema) -> tuple[Param, ...]:
    """What a Python binding of ``schema`` takes. One rule beyond the schema: an out overload's
    out arguments (``Tensor(a!) attention_out, Tensor(b!) softmax_lse``) are passed as one
    keyword ``out=[...]``, the form torch binds and torch_npu's own docs and graph handlers use
    (``torch_npu/npu/_npugraph_handlers/ifa_handler.py``: ``kwargs["out"] = [output, lse]``)."""
    params = [p for p in schema.params if not p.is_out]
    if any(p.is_out for p in schema.params):
        params.append(Param("out", kw_only=True))
    return tuple(params)


def differences(want: tuple[Param, ...], got: tuple[Param, ...]) -> list[str]:
    """Every way ``got`` (the emulator) differs from ``want`` (the schema), as sentences."""
    problems = []
    w = {p.name: p for p in want}
    g = {p.name: p for p in got}
    for name in w.keys() - g.keys():
        problems.append(f"missing parameter: {w[name].describe()}")
    for name in g.keys() - w.keys():
        problems.append(f"parameter not in the schema: {g[name].describe()}")
    for name in w.keys() & g.keys():
        a, b = w[name], g[name]
        if a.kw_only != b.kw_only:
            problems.append(f"{name}: schema has it {a.describe()}, emulator {b.describe()}")
        elif not _same_default(a.default, b.default):
            problems.append(f"{name}: schema default {a.default!r}, emulator {b.default!r}")
    positional_w = [p.name for p in want if not p.kw_only]
    positional_g = [p.name for p in got if not p.kw_only]
    if not problems and positional_w != positional_g:
        problems.append(f"positional order: schema {positional_w}, emulator {positional_g}")
    return problems


def _same_default(a: object, b: object) -> bool:
    if a is NO_DEFAULT or b is NO_DEFAULT:
        return a is b
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b
