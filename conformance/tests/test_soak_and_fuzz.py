"""The soak and the API fuzz catch what they are for, say where, and draw the same steps from the
same seed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mutants
import pytest
from attnhub_conformance import fuzz, soak

from attnhub import AttentionBackend
from attnhub.errors import InvalidInputError
from attnhub.torch_backend import TorchBackend


def _backend(cls: type[AttentionBackend]) -> AttentionBackend:
    return cls(soak.default_spec(cls), "cpu")


def _figures(report: soak.SoakReport) -> dict[str, object]:
    facts = dict(vars(report))
    for measured in ("seconds", "rss_growth_mib", "tensor_growth_mib"):
        del facts[measured]
    return facts


def test_the_soak_passes_a_conforming_backend_and_exercises_every_engine_event() -> None:
    report = soak.run(_backend(TorchBackend), 200, seed=1)
    assert report.ok, report.failures()
    assert report.steps >= 190
    for event in (
        "chunked_prefills",
        "multi_token_decodes",
        "rejected_drafts",
        "preempted_recompute",
        "preempted_swap",
        "forks",
        "copy_on_write",
        "padding_rows",
        "poisoned_blocks",
        "cache_checks",
        "requests_finished",
    ):
        assert getattr(report, event) > 0, event


def test_the_soak_draws_the_same_steps_from_the_same_seed() -> None:
    first = soak.run(_backend(TorchBackend), 60, seed=5)
    again = soak.run(_backend(TorchBackend), 60, seed=5)
    other = soak.run(_backend(TorchBackend), 60, seed=6)
    assert _figures(first) == _figures(again)
    assert _figures(first) != _figures(other)


def test_the_soak_builds_cascade_steps_where_cascade_is_declared() -> None:
    report = soak.run(_backend(mutants.CascadeBackend), 200, seed=0)
    assert report.ok, report.failures()
    assert report.cascade_steps > 0


def test_the_soak_adapts_to_a_backend_without_chunked_prefill_or_multi_token_decode() -> None:
    report = soak.run(_backend(mutants.RestrictedBackend), 100, seed=0)
    assert report.ok, report.failures()
    assert report.chunked_prefills == report.multi_token_decodes == report.forks == 0


def test_the_soak_catches_top_left_causal_alignment_and_names_the_step_and_seed() -> None:
    report = soak.run(_backend(mutants.TopLeftCausalBackend), 30, seed=3)
    assert report.divergences > 0
    assert report.messages[0].startswith("step ")
    assert "(seed 3)" in report.messages[0]
    assert "differs from the shadow model" in report.messages[0]


def test_the_soak_catches_writes_through_padding_slots() -> None:
    report = soak.run(_backend(mutants.WritesPaddingBackend), 100, seed=3)
    assert not report.ok
    assert report.corruptions + report.divergences > 0


def test_the_soak_catches_a_block_copy_that_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(soak.PagedKVCache, "copy_blocks", lambda self, mapping: None)
    report = soak.run(_backend(TorchBackend), 200, seed=1)
    assert report.copy_on_write > 0
    assert report.corruptions + report.divergences > 0


def test_the_soak_counts_an_error_on_a_valid_step_and_stops_there() -> None:
    class RefusesEverything(TorchBackend):
        name = "refuses_everything"

        def metadata_builder(self):  # type: ignore[no-untyped-def]
            builder = super().metadata_builder()

            def refuse(*args: object, **kwargs: object) -> object:
                raise KeyError("boom")

            builder.plan = refuse  # type: ignore[method-assign]
            return builder

    report = soak.run(_backend(RefusesEverything), 50, seed=0)
    assert report.untyped_errors == 1
    assert report.steps == 0
    assert "raised KeyError" in report.messages[0]


def test_the_fuzz_spoils_every_target_and_passes_a_conforming_backend() -> None:
    report = fuzz.run(_backend(TorchBackend), 2 * len(fuzz.TARGETS), seed=0)
    assert report.ok, report.failures()
    assert set(report.examples) == set(fuzz.TARGETS)
    assert all(n == 2 for n in report.examples.values()), report.examples
    assert report.accepted and report.typed_errors


def test_the_fuzz_catches_an_out_of_range_slot_that_is_not_refused_with_a_typed_error() -> None:
    report = fuzz.run(_backend(mutants.CorruptsOnBadSlotBackend), 8 * len(fuzz.TARGETS), seed=0)
    assert report.untyped_errors > 0
    assert any(" slot_mapping/outside: raised " in m for m in report.messages), report.messages


def test_the_fuzz_catches_a_refusal_after_a_write() -> None:
    class WritesThenRefuses(TorchBackend):
        name = "writes_then_refuses"

        def impl(self, **kwargs):  # type: ignore[no-untyped-def]
            impl = super().impl(**kwargs)
            store = impl.store_kv

            def store_then_refuse(key, value, cache, slots, meta=None):  # type: ignore[no-untyped-def]
                store(key, value, cache, slots, meta)
                if meta is not None and meta.batch.num_reqs > 1:
                    raise InvalidInputError("refused after the write")

            impl.store_kv = store_then_refuse  # type: ignore[method-assign]
            return impl

    report = fuzz.run(_backend(WritesThenRefuses), 3 * len(fuzz.TARGETS), seed=0)
    assert report.corruptions > 0
    assert any(
        "refused (refused after the write) after changing the cache" in m for m in report.messages
    )


def test_the_fuzz_counts_untyped_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def untyped(self: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("untyped")

    monkeypatch.setattr(soak.PagedKVCache, "copy_blocks", untyped)
    report = fuzz.run(_backend(TorchBackend), 3 * len(fuzz.TARGETS), seed=0)
    assert report.untyped_errors > 0
    assert any("raised RuntimeError" in m for m in report.messages)


def test_a_known_defect_matches_only_its_variant_and_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fuzz, "KNOWN_DEFECTS", {("vendor-*", "strides/seq_lens"): "defect 9"})
    assert fuzz.known_defect("vendor-v2", "strides/seq_lens") == "defect 9"
    assert fuzz.known_defect("torch", "strides/seq_lens") is None
    assert fuzz.known_defect("vendor-v2", "strides/seq_lens/one_request") is None


def test_the_fuzz_labels_a_provider_backend_with_its_provider() -> None:
    class WithProvider(TorchBackend):
        name = "vendor"
        provider = "v2"

    assert fuzz.backend_label(_backend(WithProvider)) == "vendor-v2"
    assert fuzz.backend_label(_backend(TorchBackend)) == "torch"


def test_the_default_spec_is_one_the_backend_serves() -> None:
    for cls in (TorchBackend, mutants.RestrictedBackend):
        spec = soak.default_spec(cls)
        assert not cls.unsupported_reasons(spec)
        assert spec.kv_cache_dtype == "auto"
    restricted = soak.default_spec(mutants.RestrictedBackend)
    assert replace(restricted, head_size=128) == restricted


def test_the_command_prints_the_figures_and_the_fault_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = tmp_path / "figures.jsonl"
    argv = ["--backend", "torch", "--steps", "20", "--fuzz-examples", "13", "--seed", "2"]
    assert soak.main([*argv, "--json", str(figures), "--label", "torch-x"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("soak torch-x [bfloat16 h64 8/2 heads bs16] seed 2: ")
    assert "\nfuzz torch-x seed 2: 13 examples (lengths 1, " in printed
    table = soak.fault_table(str(figures))
    soak_row, fuzz_row = (line for line in table.splitlines() if line.startswith("| torch-x |"))
    assert 15 <= int(soak_row.split(" | ")[2]) <= 20  # steps run: one with nothing to do is not
    assert fuzz_row.split(" | ")[1] == "13"


def test_the_command_refuses_an_unknown_backend_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before any soak (it takes minutes per backend), not a NoBackendError traceback after."""
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--backend", "torch", "--backend", "no_such_backend", "--steps", "1"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "--backend: no backend named 'no_such_backend' (known: " in captured.err
    assert "soak torch" not in captured.out  # nothing ran
