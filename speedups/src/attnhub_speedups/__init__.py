"""Optional compiled passes for attnhub's host-side checks (``pip install attnhub[speedups]``).

attnhub imports what it finds here and falls back to its pure-Python rules otherwise, with the
same verdicts, errors and facts (``attnhub.validation``; ``ATTNHUB_SPEEDUPS=0`` turns it off).
"""

from attnhub_speedups._step_values import step_values

__all__ = ["step_values"]
