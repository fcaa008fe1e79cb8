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

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from attnhub_conformance import contracts
from attnhub_conformance.contracts import NO_DEFAULT, Param

WHEEL_REQUIREMENT = "torch-npu==2.10.0.post4"
WHEEL_GLOB = "torch_npu-2.10.0.post4-*.whl"
YAML_PATH = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
ATB_LIBRARY = "torch_npu/lib/libop_plugin_atb.so"
#: An emulator function's parameters, comparable with the published ones.
from_signature = contracts.params_of

NPU_WHEEL = contracts.VendorArtifact(WHEEL_REQUIREMENT, WHEEL_GLOB, timeout_s=600)


@dataclass(frozen=True)
class Schema:
    name: str  # "npu_fused_infer_attention_score" or "npu_fused_infer_attention_score.out"
    params: tuple[Param, ...]
    text: str


def find_or_download_wheel() -> tuple[Path | None, str]:
    """The cached wheel, downloading it once if needed: (path, "") or (None, why not)."""
    return contracts.find_or_download(NPU_WHEEL)


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
    return contracts.differences(want, got, source="the schema")
