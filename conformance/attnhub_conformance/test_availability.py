"""Every selected backend loads, runs on the device, and serves at least one spec the suite can
build. One that cannot run here is skipped with why not, unless the run needed it: a backend
named with --attnhub-backend (or every one, when none of a default run can run) fails instead,
so that a run which tests nothing does not pass."""

from __future__ import annotations

import pytest

from attnhub_conformance.cases import Case


@pytest.mark.attnhub_cases("availability")
def test_backend_is_usable(case: Case) -> None:
    target = case.target
    if target.cannot_run is not None:
        pytest.fail(f"{case.id}: {target.cannot_run}")
    caps = target.capabilities
    assert case.config is not None, (
        f"{case.id}: no configuration the suite can build is supported (declared: {caps.summary()})"
    )
    spec = case.config.spec()
    backend = target.create(spec)
    cache = backend.allocate_kv_cache(4)
    assert cache.layout == caps.kv_cache_layout, (
        f"{case.id}: allocate_kv_cache gave layout {cache.layout!r}, capabilities declare "
        f"{caps.kv_cache_layout!r}"
    )
    assert (cache.num_blocks, cache.block_size, cache.kv_cache_dtype) == (
        4,
        spec.block_size,
        spec.kv_cache_dtype,
    ), f"{case.id}: allocate_kv_cache(4) gave {cache.num_blocks} blocks of {cache.block_size}"
    assert backend.emulated == target.emulated, (
        f"{case.id}: the instance says emulated={backend.emulated}, the class "
        f"is_emulated() says {target.emulated}"
    )
