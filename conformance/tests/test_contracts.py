"""attnhub_conformance.contracts: what every vendor backend's contract test shares (artifact cache,
parameter comparison)."""

from __future__ import annotations

import inspect

import pytest
from attnhub_conformance import contracts
from attnhub_conformance.contracts import NO_DEFAULT, Param


def emulated(q, k, scale=1.0, *, softcap=0.0, out=None, **kwargs):
    return None


def test_params_of_reads_kind_and_default_and_skips_var_keyword() -> None:
    assert contracts.params_of(inspect.signature(emulated)) == (
        Param("q", False),
        Param("k", False),
        Param("scale", False, 1.0),
        Param("softcap", True, 0.0),
        Param("out", True, None),
    )


def test_agreeing_signatures_have_no_differences() -> None:
    got = contracts.params_of(inspect.signature(emulated))
    want = (Param("q", False), Param("k", False), Param("scale", False, 1))  # 1 == 1.0
    want += (Param("softcap", True, 0), Param("out", True, None))
    assert contracts.differences(want, got) == []


@pytest.mark.parametrize(
    ("want", "expected"),
    [
        ((Param("q", False), Param("k", False), Param("v", False)), "missing parameter"),
        ((Param("q", False),), "parameter not in the interface: positional k"),
        ((Param("q", False), Param("k", True)), "k: the interface has it keyword-only k"),
        ((Param("q", False), Param("k", False, 2)), "k: the interface default 2"),
        ((Param("k", False), Param("q", False)), "positional order"),
    ],
)
def test_each_kind_of_difference_is_a_sentence(want: tuple[Param, ...], expected: str) -> None:
    got = (Param("q", False), Param("k", False))
    problems = contracts.differences(want, got, source="the interface")
    assert any(expected in p for p in problems), problems


def test_defaults_compare_by_value_not_by_type_of_number() -> None:
    assert contracts.same_default(1, 1.0)
    assert not contracts.same_default(True, 1)  # a bool is not a number here
    assert not contracts.same_default(None, NO_DEFAULT)
    assert contracts.same_default((None, None), [None, None])
    assert contracts.same_default("torch.float32", __import__("torch").float32)


def test_a_cached_artifact_is_found_without_downloading(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATTNHUB_WHEEL_CACHE", str(tmp_path))
    (tmp_path / "vendor_lib-1.0-py3-none-any.whl").write_bytes(b"")
    artifact = contracts.VendorArtifact("vendor-lib==1.0", "vendor_lib-1.0-*.whl")
    assert contracts.find_or_download(artifact) == (
        tmp_path / "vendor_lib-1.0-py3-none-any.whl",
        "",
    )


def test_a_failed_download_returns_the_reason_never_a_path(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ATTNHUB_WHEEL_CACHE", str(tmp_path))
    artifact = contracts.VendorArtifact(
        "attnhub-no-such-vendor-lib==9.9", "attnhub_no_such*.whl", pip_args=("--no-index",)
    )
    path, why = contracts.find_or_download(artifact)
    assert path is None
    assert "attnhub-no-such-vendor-lib==9.9" in why and "failed (exit" in why


def test_a_pinned_artifact_is_checked_by_hash_and_size(tmp_path, monkeypatch) -> None:
    import hashlib

    monkeypatch.setenv("ATTNHUB_WHEEL_CACHE", str(tmp_path))
    wheel = tmp_path / "vendor_lib-1.0-py3-none-any.whl"
    wheel.write_bytes(b"the pinned bytes")
    pinned = hashlib.sha256(b"the pinned bytes").hexdigest()
    ok = contracts.VendorArtifact("vendor-lib==1.0", "vendor_lib-1.0-*.whl", sha256=pinned)
    assert contracts.find_or_download(ok) == (wheel, "")
    other = contracts.VendorArtifact("vendor-lib==1.0", "vendor_lib-1.0-*.whl", sha256="0" * 64)
    with pytest.raises(contracts.ArtifactMismatchError, match="sha256"):
        contracts.find_or_download(other)
    small = contracts.VendorArtifact("vendor-lib==1.0", "vendor_lib-1.0-*.whl", min_bytes=1000)
    with pytest.raises(contracts.ArtifactMismatchError, match="bytes"):
        contracts.find_or_download(small)
