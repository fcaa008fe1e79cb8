"""The core package speaks of no vendor (vendor facts live in the backend packages and their
docs) and of no project history (issues, internal notes)."""

from __future__ import annotations

import re
from pathlib import Path

import attnhub

CORE = Path(attnhub.__file__).parent
VENDOR_WORDS = re.compile(
    r"\b(ascend|iluvatar|ixformer|torch_npu|corex|cann)\b|\bnpu_\w+"
    # a vendor kernel's internals (FlashAttention's sources, its constants) belong to its backend
    r"|\b(flashattention(-\d)?|flash_attn\w*|hopper|fa[234]|sm_?90|max_offset)\b"
)
HISTORY_WORDS = (r"\bissue", r"\bsession \d", r"\bTODO\b")


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(CORE.rglob("*.py"))]


def test_no_vendor_name_in_the_core() -> None:
    found = [
        f"{p.relative_to(CORE)}:{n}: {line.strip()}"
        for p, text in _sources()
        for n, line in enumerate(text.splitlines(), 1)
        if VENDOR_WORDS.search(line.lower())
    ]
    assert not found, "\n".join(found)


def test_no_project_history_in_the_core() -> None:
    found = [
        f"{p.relative_to(CORE)}:{n}: {line.strip()}"
        for p, text in _sources()
        for n, line in enumerate(text.splitlines(), 1)
        if any(re.search(w, line, re.IGNORECASE) for w in HISTORY_WORDS)
    ]
    assert not found, "\n".join(found)
