"""Multi-rank cases (marker ``multi_rank``): decode context parallel through the backend over
real gloo process groups spawned per case, for any backend that declares the LSE, and of MLA
layers (the absorbed form) for any backend that declares the MLA LSE
(``attnhub_conformance.multi_rank``). Deselect with ``-m "not multi_rank"``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attnhub_conformance.cases import Case
from attnhub_conformance.mla_cases import MLACase
from attnhub_conformance.multi_rank import backend_ref, run_group, sub_cases


@pytest.mark.multi_rank
@pytest.mark.attnhub_cases("multi_rank")
def test_decode_context_parallel(case: Case) -> None:
    target, config = case.target, case.config
    assert config is not None and case.entry is not None and target.backend is not None
    spec, n = config.spec(), int(case.entry)
    with_sinks = [replace(spec, use_sinks=True, num_heads=h) for h in (spec.num_heads,
                  n * spec.num_heads)]  # fmt: skip
    sinks = target.capabilities.sinks and not any(target.refusal(s) for s in with_sinks)
    job = dict(
        backend=backend_ref(target.backend, target.name),
        spec=spec,
        device=target.device,
        emulate=target.emulate,
        sub_cases=sub_cases(spec.block_size, sinks),
    )
    reports = run_group(n, job)
    failures = [
        f"rank {rank}, {sub}: {error}"
        for rank, report in sorted(reports.items())
        for sub, found in report.items()
        for error in found["errors"]
    ]
    assert not failures, f"{target.name}, decode context parallel over {n} ranks:\n" + "\n".join(
        failures
    )


@pytest.mark.multi_rank
@pytest.mark.attnhub_cases("multi_rank_mla")
def test_mla_decode_context_parallel(case: MLACase) -> None:
    target = case.target
    assert case.mla is not None and case.entry is not None and target.backend is not None
    spec, n = case.mla.spec(), int(case.entry)
    job = dict(
        backend=backend_ref(target.backend, target.name),
        spec=spec,
        device=target.device,
        emulate=target.emulate,
        sub_cases=sub_cases(spec.block_size, sinks=False),
    )
    reports = run_group(n, job)
    failures = [
        f"rank {rank}, {sub}: {error}"
        for rank, report in sorted(reports.items())
        for sub, found in report.items()
        for error in found["errors"]
    ]
    assert not failures, (
        f"{target.name}, decode context parallel of an MLA layer over {n} ranks:\n"
        + "\n".join(failures)
    )
