"""``attnhub bench --host`` times vLLM's own CPU backend on the same steps as attnhub's,
through the host comparison this integration registers (hook ``attnhub_host_comparisons``)."""

from __future__ import annotations

import pytest
from attnhub_vllm import plugin

from attnhub import bench

pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


def test_vllms_cpu_backend_is_timed_on_the_bench_steps() -> None:
    from attnhub_vllm.bench import VLLM_CPU, vllm_cpu_unavailable, vllm_host_overhead

    assert vllm_cpu_unavailable("cpu") is None
    row = vllm_host_overhead("mixed x16")
    assert row.backend == VLLM_CPU and row.num_reqs == 16 and row.external
    assert row.build_us > 0 and row.forward_us > 0 and row.write_kv_us > 0
    assert row.forward_full_us is not None and row.forward_full_us > 0


def test_vllms_real_kernels_run_on_the_bench_setup() -> None:
    """The builder and impl the bench constructs run vLLM's real kernels (the full forward)
    and their ops are restored after the null-kernel timing."""
    from attnhub_vllm.bench import vllm_host_overhead
    from vllm.v1.attention.backends import cpu_attn

    real = cpu_attn.ops
    vllm_host_overhead("decode x1")
    assert cpu_attn.ops is real


def test_the_plugins_host_comparison_runs_through_the_core_bench() -> None:
    """The hook's comparison, as ``attnhub bench --host`` runs it (the core names no vLLM)."""
    (comparison,) = plugin.attnhub_host_comparisons()
    assert comparison.unavailable("cpu") is None
    assert comparison.unavailable("cuda") is not None
    row = bench.run_host_comparison(comparison, "decode x1")
    assert row.backend == comparison.name and row.external and row.null_kernels
