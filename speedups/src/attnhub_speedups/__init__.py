"""Optional compiled passes for attnhub's host-side checks (``pip install attnhub[speedups]``).

``_step_values`` (C): a step's length and value rules in one pass over its host copies.
``_step_structure`` (C++ over torch's C++ API, built only where torch is importable while
building, and used only with that torch): a step's structure rules and dense-batch test.

attnhub imports what it finds here and falls back to its pure-Python rules otherwise, with the
same verdicts, errors and facts (``attnhub.validation``; ``ATTNHUB_SPEEDUPS=0`` turns it off).
"""

from attnhub_speedups._step_values import step_values

__all__ = ["step_values"]
