"""The property test draws the same examples on every run unless asked otherwise: a CI run of
the suite is never flaky, and a failure found with ``--attnhub-hypothesis-seed random`` can be
rerun from the seed it names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from suite_runs import SuiteRun, make_runner

PROPERTIES = "test_random_batches_match_reference"


@pytest.fixture
def run_suite(tmp_path: Path):
    return make_runner(tmp_path)


def drawn(run: SuiteRun) -> list[str]:
    """The examples the property test tried, as hypothesis's verbose report prints them."""
    assert run.returncode == 0, run.output[-3000:]
    examples = re.findall(r"^Trying example: check\(.*?^\)$", run.output, re.M | re.S)
    examples = examples or re.findall(r"^Test case: check\(.*?^\)$", run.output, re.M | re.S)
    assert len(examples) >= 3, run.output[-3000:]
    return examples


def properties(run_suite, *args: str) -> SuiteRun:
    return run_suite(
        "--attnhub-backend",
        "torch",
        "-k",
        PROPERTIES,
        "--attnhub-hypothesis-examples",
        "4",
        "-s",
        "--hypothesis-verbosity=verbose",
        *args,
    )


def test_default_runs_draw_the_same_examples(run_suite) -> None:
    run = properties(run_suite)
    first = drawn(run)
    assert "draws them again" not in run.output  # a fixed seed that passed needs no mention
    assert drawn(properties(run_suite)) == first
    # The default is seed 0; another seed draws other examples.
    assert drawn(properties(run_suite, "--attnhub-hypothesis-seed", "0")) == first
    assert drawn(properties(run_suite, "--attnhub-hypothesis-seed", "1")) != first


def test_a_random_seed_is_named_and_reruns_its_examples(run_suite) -> None:
    run = properties(run_suite, "--attnhub-hypothesis-seed", "random")
    said = re.search(
        r"hypothesis seed (\d+); --attnhub-hypothesis-seed \1 draws them again", run.output
    )
    assert said, run.output[-3000:]
    again = properties(run_suite, "--attnhub-hypothesis-seed", said[1])
    assert drawn(again) == drawn(run)


def test_a_failure_names_the_seed_that_reruns_it(run_suite) -> None:
    run = run_suite(
        "--attnhub-backend",
        "loose_tolerance",
        "-k",
        PROPERTIES,
        "--attnhub-hypothesis-examples",
        "2",
        "--attnhub-hypothesis-seed",
        "7",
    )
    assert run.returncode == 1, run.output[-3000:]
    said = "hypothesis seed 7; --attnhub-hypothesis-seed 7 draws them again"
    assert said in run.output, run.output[-3000:]
    if sys.version_info >= (3, 11):  # the failure itself says so too (exception notes)
        assert "drawn with --attnhub-hypothesis-seed 7" in run.output, run.output[-3000:]


@pytest.mark.parametrize("bad", ["-1", "seven"])
def test_a_bad_seed_is_a_usage_error(run_suite, bad: str) -> None:
    run = run_suite("--attnhub-backend", "torch", "--attnhub-hypothesis-seed", bad)
    assert run.returncode == 4, run.output[-3000:]
    assert f"--attnhub-hypothesis-seed {bad}: use a non-negative integer or 'random'" in run.output


@pytest.mark.parametrize("bad", ["-3", "0"])
def test_a_count_of_no_examples_is_a_usage_error(run_suite, bad: str) -> None:
    run = run_suite("--attnhub-backend", "torch", "--attnhub-hypothesis-examples", bad)
    assert run.returncode == 4, run.output[-3000:]
    assert f"--attnhub-hypothesis-examples {bad}: use a positive number of examples" in run.output
