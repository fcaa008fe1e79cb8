"""The soak and the API fuzz, bounded: a few hundred engine steps against the shadow model and a
hundred-odd spoiled calls per backend, from a fixed seed (``--attnhub-soak-steps``,
``--attnhub-fuzz-examples``, ``--attnhub-soak-seed``). The end of the run prints their figures.
``nox -s soak`` runs the long ones (docs/reliability.md)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from attnhub.errors import UnsupportedConfigurationError
from attnhub_conformance import fuzz, soak
from attnhub_conformance.cases import Case


def _backend(case: Case):  # type: ignore[no-untyped-def]
    assert case.target.backend is not None
    try:
        spec = soak.default_spec(case.target.backend)
    except UnsupportedConfigurationError as exc:
        pytest.skip(f"no small unquantized decoder spec to soak: {exc}")
    return case.target.create(spec)


@pytest.mark.attnhub_cases("soak")
def test_soak_matches_the_shadow_model(
    case: Case,
    attnhub_soak_options: tuple[int, int, int],
    attnhub_figures: Callable[[str], None],
) -> None:
    steps, _, seed = attnhub_soak_options
    report = soak.run(_backend(case), steps, seed)
    attnhub_figures(report.summary())
    assert report.ok, f"{case.id}: {report.summary()}\n{report.failures()}"


@pytest.mark.attnhub_cases("fuzz")
def test_api_fuzz_raises_typed_errors_and_keeps_caches(
    case: Case,
    attnhub_soak_options: tuple[int, int, int],
    attnhub_figures: Callable[[str], None],
) -> None:
    _, examples, seed = attnhub_soak_options
    report = fuzz.run(_backend(case), examples, seed)
    attnhub_figures(report.summary())
    assert report.ok, f"{case.id}: {report.summary()}\n{report.failures()}"
