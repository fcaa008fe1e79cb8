"""The emulator's op signatures match torch_npu's published schemas (the ``contracts`` check).

Downloads ``torch-npu==2.10.0.post4`` once (``pip download --no-deps``, cached in
``$ATTNHUB_WHEEL_CACHE``, default ``~/.cache/attnhub/wheels``), reads the schemas out of the
wheel as a zip (see ``npu_schema``) and compares every emulated op's names, positional /
keyword-only split and defaults with its Python signature. Skips, saying why, only when the
wheel cannot be had.
"""

from __future__ import annotations

import inspect

import npu_schema
import pytest
from attnhub_ascend import emulator

pytestmark = pytest.mark.contract

#: Emulated ops that are not in the codegen YAML, with where their signature comes from instead.
#: Each is still checked, against that source.
EXEMPT_FROM_YAML = {
    "_npu_reshape_and_cache": (
        "an ATB op: registered by torch_npu's ATB op plugin (torch_npu/op_plugin/atb/_atb_ops.py "
        "lists it; torch.ops.atb), not by the codegen YAML; its schema string is read from "
        f"{npu_schema.ATB_LIBRARY} in the same wheel"
    ),
}


@pytest.fixture(scope="module")
def wheel() -> object:
    path, why = npu_schema.find_or_download_wheel()
    if path is None:
        pytest.skip(f"cannot download {npu_schema.WHEEL_REQUIREMENT} for the contract: {why}")
    return path


@pytest.fixture(scope="module")
def yaml(wheel: object) -> dict[str, list[npu_schema.Schema]]:
    return npu_schema.yaml_schemas(wheel)  # type: ignore[arg-type]


def _overloads() -> list[tuple[str, object]]:
    out = []
    for name, packet in emulator.OPS.items():
        out.append((name, packet.default))
        if hasattr(packet, "out"):
            out.append((name + ".out", packet.out))
    return out


def test_the_yaml_is_the_schema_we_expect(yaml: dict[str, list[npu_schema.Schema]]) -> None:
    assert sum(len(v) for v in yaml.values()) > 1000, "the codegen YAML looks truncated"
    assert "npu_fused_infer_attention_score.out" in yaml


def test_ops_missing_from_the_yaml_are_exactly_the_listed_exemptions(
    yaml: dict[str, list[npu_schema.Schema]],
) -> None:
    missing = {name for name in emulator.OPS if name not in yaml}
    assert missing == set(EXEMPT_FROM_YAML), (
        f"emulated ops absent from {npu_schema.YAML_PATH}: {sorted(missing)}; listed "
        f"exemptions: {sorted(EXEMPT_FROM_YAML)} (document each new one with the source of "
        "its signature)"
    )


@pytest.mark.parametrize(("name", "fn"), _overloads(), ids=[n for n, _ in _overloads()])
def test_emulated_signature_matches_the_vendor_schema(
    name: str, fn: object, wheel: object, yaml: dict[str, list[npu_schema.Schema]]
) -> None:
    base = name.removesuffix(".out")
    if base in EXEMPT_FROM_YAML:
        schema = npu_schema.atb_schema(wheel, name)  # type: ignore[arg-type]
        assert schema is not None, f"{name}: not in the YAML and not in {npu_schema.ATB_LIBRARY}"
        source = f"{npu_schema.ATB_LIBRARY} (exempt from the YAML: {EXEMPT_FROM_YAML[base]})"
    else:
        entries = yaml.get(name)
        assert entries, f"{name} is not in {npu_schema.YAML_PATH}"
        texts = {s.text for s in entries}
        assert len(texts) == 1, f"{name} has {len(texts)} different schemas in the YAML"
        schema = entries[0]
        source = npu_schema.YAML_PATH
    got = npu_schema.from_signature(inspect.signature(fn))  # type: ignore[arg-type]
    problems = npu_schema.differences(npu_schema.expected_python_params(schema), got)
    assert not problems, (
        f"emulated torch_npu.{name} differs from {source}:\n  - "
        + "\n  - ".join(problems)
        + f"\nschema: {schema.text}"
    )


def test_the_schema_parser_reads_kinds_and_defaults() -> None:
    s = npu_schema.parse(
        'f.out(Tensor q, int n, *, str layout="BSH", float s=1., int[]? l=None, '
        "str? mode='PA_NZ', Tensor(a!) o) -> Tensor(a!)"
    )
    P = npu_schema.Param
    assert s.params == (
        P("q", False),
        P("n", False),
        P("layout", True, "BSH"),
        P("s", True, 1.0),
        P("l", True, None),
        P("mode", True, "PA_NZ"),
        P("o", True, is_out=True),
    )
    assert npu_schema.expected_python_params(s)[-1] == P("out", True)


def test_a_wrong_keyword_is_reported() -> None:
    want = npu_schema.parse("f(Tensor q, *, float scale=1.0) -> Tensor").params
    got = npu_schema.parse("f(Tensor q, *, float scale_value=1.0) -> Tensor").params
    problems = npu_schema.differences(want, got)
    assert any("missing parameter" in p and "scale" in p for p in problems)
    assert any("not in the schema" in p and "scale_value" in p for p in problems)


def test_both_kv_write_ops_are_emulated_and_checked(
    yaml: dict[str, list[npu_schema.Schema]],
) -> None:
    """The 910B default (npu_scatter_pa_kv_cache, from the YAML) and the 310P one (ATB's
    _npu_reshape_and_cache, from its registration string) are both held to a vendor schema."""
    assert "npu_scatter_pa_kv_cache" in emulator.OPS and "npu_scatter_pa_kv_cache" in yaml
    assert "npu_scatter_pa_kv_cache" not in EXEMPT_FROM_YAML
    assert "_npu_reshape_and_cache" in emulator.OPS


def test_npu_fusion_attention_has_a_sink_argument_in_this_wheel(
    yaml: dict[str, list[npu_schema.Schema]],
) -> None:
    """torch-npu 2.10.0.post4 declares ``Tensor? sink=None`` (the doc: float32 [head_num],
    CANN 8.5+). attnhub does not pass it (docs/backends/ascend.md says why); the emulator
    carries it so the signature matches, and refuses it as not emulated."""
    (schema,) = {s.text: s for s in yaml["npu_fusion_attention"]}.values()
    assert any(p.name == "sink" and p.default is None for p in schema.params)


def _atb_overloads() -> list[tuple[str, object]]:
    from attnhub_ascend import emulator_atb

    return [
        (name if key == "default" else f"{name}.{key}", fn)
        for name, packet in emulator_atb.ATB_OPS.items()
        for key, fn in packet.overloads.items()
    ]


@pytest.mark.parametrize(("name", "fn"), _atb_overloads(), ids=[n for n, _ in _atb_overloads()])
def test_emulated_atb_op_matches_its_registration_in_the_atb_library(
    name: str, fn: object, wheel: object, yaml: dict[str, list[npu_schema.Schema]]
) -> None:
    """``torch_npu.atb.*`` (ATB's MLA op and its workspace query) are ``torch.ops.atb``
    packets: absent from the codegen YAML, registered from schema strings in
    ``libop_plugin_atb.so``. Each emulated overload matches its string; out arguments are
    passed by their schema names (``output=``, ``lse=``), as torch binds an op overload and
    vllm-ascend calls it."""
    assert name.split(".")[0] not in yaml, f"{name} is in the YAML: check it there instead"
    schema = npu_schema.atb_schema(wheel, name)  # type: ignore[arg-type]
    assert schema is not None, f"{name}: not registered in {npu_schema.ATB_LIBRARY}"
    assert schema.name == name, f"found {schema.name!r} for {name!r}"
    got = npu_schema.from_signature(inspect.signature(fn))  # type: ignore[arg-type]
    problems = npu_schema.differences(schema.params, got)
    assert not problems, (
        f"emulated torch_npu.atb.{name} differs from {npu_schema.ATB_LIBRARY}:\n  - "
        + "\n  - ".join(problems)
        + f"\nschema: {schema.text}"
    )


def test_every_overload_atb_registers_for_the_mla_op_is_emulated(wheel: object) -> None:
    """The four overloads of npu_multi_head_latent_attention in this wheel (default, out, lse,
    lse_out) are all emulated, so the packet resolves a call as torch would."""
    import re
    import zipfile

    with zipfile.ZipFile(wheel) as z:  # type: ignore[call-overload]
        data = z.read(npu_schema.ATB_LIBRARY)
    found = set(re.findall(rb"\bnpu_multi_head_latent_attention(\.\w+)?\(", data))
    registered = {("npu_multi_head_latent_attention" + s.decode()) for s in found}
    emulated = {n for n, _ in _atb_overloads() if n.startswith("npu_multi")}
    assert registered == emulated
