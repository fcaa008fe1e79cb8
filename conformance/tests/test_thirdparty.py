"""A third-party backend, installed as its own distribution, is discovered through the
``attnhub`` entry-point group and passes the suite unchanged.

The distribution is written by hand into a temporary directory (a package plus a
``thirdparty-0.1.dist-info`` with METADATA and entry_points.txt: ``suite_runs.write_distribution``)
and put on PYTHONPATH of a subprocess: exactly what an installed wheel looks like to
importlib.metadata.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from suite_runs import suite_env, write_distribution

BACKEND = '''
"""A third-party attnhub backend: the portable torch math under another name."""
from attnhub.torch_backend import TorchBackend


class ThirdPartyBackend(TorchBackend):
    name = "thirdparty"
'''

PLUGIN = """
import attnhub
from thirdparty_attn import ThirdPartyBackend


@attnhub.hookimpl
def attnhub_backends():
    return [ThirdPartyBackend]
"""


@pytest.fixture(scope="module")
def distribution(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_distribution(
        tmp_path_factory.mktemp("site"),
        "thirdparty",
        "0.1",
        {"thirdparty_attn/__init__.py": BACKEND, "thirdparty_attn/plugin.py": PLUGIN},
        {"attnhub": {"thirdparty": "thirdparty_attn.plugin"}},
    )


def test_entry_point_backend_is_listed_and_selected(distribution: Path) -> None:
    script = textwrap.dedent("""
        import torch, attnhub
        infos = {i.name: i for i in attnhub.list_backends()}
        info = infos["thirdparty"]
        assert info.backend is not None and info.error is None, info
        assert (info.distribution, info.version) == ("thirdparty", "0.1"), info
        spec = attnhub.AttentionSpec(num_heads=8, num_kv_heads=2, head_size=64,
                                     dtype=torch.bfloat16, block_size=16)
        backend = attnhub.select_backend(spec, "cpu", prefer="thirdparty")
        assert backend.name == "thirdparty", backend
        assert type(backend).__name__ == "ThirdPartyBackend", backend
        print("ok", sorted(infos))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=suite_env((distribution,)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "thirdparty" in proc.stdout


def test_third_party_backend_passes_the_suite(run_suite, distribution: Path) -> None:
    run = run_suite("--attnhub-backend", "thirdparty", extra_path=(distribution,), mutants=False)
    assert run.returncode == 0, run.output[-4000:]
    assert run.report is not None
    assert run.report["backends"]["thirdparty"]["distribution"] == "thirdparty"
    assert run.state("batch: chunked_prefill", "thirdparty") == "pass"
    assert run.state("random batches (hypothesis)", "thirdparty") == "pass"
