"""Exit codes and the restart decision of the supervisor: pure rules, no processes.

See :mod:`ingest.supervisor` for the policy in prose; this module is that
policy as functions a unit test can call directly.
"""

from __future__ import annotations

import collections
import signal
from dataclasses import dataclass

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE, EXIT_ABORTED = 0, 1, 2, 3, 130
#: Failure codes a parent exits with unchanged (anything else non-zero becomes 1).
KEPT_CODES = (EXIT_CONFIG, EXIT_UNREACHABLE)


def describe(rc: int) -> str:
    """``"exit 3"`` or ``"killed by SIGKILL"`` for a :class:`subprocess.Popen` return code."""
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def normalised_exit(rc: int | None, *, killed_by_parent: bool) -> int:
    """What one child's last return code contributes to the parent's exit code.

    Never started or still unknown: 0. Death by a signal: 1, or 130 when the
    parent SIGKILLed it after an abort. 0/1/2/3/130 are kept; others become 1.
    """
    if rc is None:
        return EXIT_OK
    if rc < 0:
        return EXIT_ABORTED if killed_by_parent else EXIT_FAILED
    return rc if rc in (EXIT_OK, EXIT_FAILED, *KEPT_CODES, EXIT_ABORTED) else EXIT_FAILED


def is_restartable(rc: int) -> bool:
    """A death a restart can cure: killed by a signal, or exit 0 / 130 nobody asked for."""
    return rc < 0 or rc in (EXIT_OK, EXIT_ABORTED)


def failure_code(rc: int) -> int:
    """The parent's exit code for a child's reported failure ``rc`` (2 and 3 kept, else 1)."""
    return rc if rc in KEPT_CODES else EXIT_FAILED


@dataclass
class RestartPolicy:
    """Backoff doubling per recent death; more than ``max_restarts`` in ``window_s`` is a crash loop."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def next_delay_s(self, deaths: collections.deque[float], now_s: float) -> float | None:
        """Record a death at ``now_s`` in ``deaths`` (pruned to the window); the restart delay, or None to give up."""
        deaths.append(now_s)
        while deaths and now_s - deaths[0] > self.window_s:
            deaths.popleft()
        if len(deaths) > self.max_restarts:
            return None
        return min(self.max_backoff_s, self.backoff_s * 2 ** (len(deaths) - 1))
