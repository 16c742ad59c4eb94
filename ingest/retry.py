"""The retry policy for transient failures, in one place (tenacity).

Exponential backoff with full jitter between ``initial_backoff_ms`` and
``max_backoff_ms``; ``max_attempts: 0`` retries forever. Only
:class:`~ingest.errors.TransientError` is retried; everything else propagates
at once. ``should_stop`` lets a shutting-down pipeline cut retries short.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_random_exponential,
)

from ingest.config import RetrySettings
from ingest.errors import TransientError

log = logging.getLogger(__name__)


def retrying(
    cfg: RetrySettings,
    *,
    what: str,
    context: dict[str, object] | None = None,
    on_retry: Callable[[], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Retrying:
    """A tenacity ``Retrying`` for ``for attempt in retrying(...): with attempt: ...`` loops."""

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            on_retry()
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "transient failure, retrying",
            extra={**(context or {}), "what": what, "attempt": state.attempt_number, "error": str(exc)},
        )

    limit = stop_never if cfg.max_attempts == 0 else stop_after_attempt(cfg.max_attempts)

    def stop(state: RetryCallState) -> bool:
        if should_stop is not None and should_stop():
            return True
        return bool(limit(state))

    return Retrying(
        retry=retry_if_exception_type(TransientError),
        wait=wait_random_exponential(multiplier=cfg.initial_backoff_ms / 1000, max=cfg.max_backoff_ms / 1000),
        stop=stop,
        before_sleep=before_sleep,
        reraise=True,
    )
