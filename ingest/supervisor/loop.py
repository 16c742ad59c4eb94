"""The supervisor loop: start P children, forward signals, reap, restart or stop, exit.

The rules it applies live in :mod:`ingest.supervisor.policy`; one child's
mechanics in :mod:`ingest.supervisor.children`. This module only sequences
them: one :meth:`Supervisor.tick` per ``poll_interval_s``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ingest.supervisor import policy
from ingest.supervisor.children import (
    Child,
    ChildTemplate,
    child_argv,
    join_grace_from_client,
)
from ingest.supervisor.summary import write_summary

log = logging.getLogger(__name__)


class Supervisor:
    """P children of one command, supervised until they all finish (see :mod:`ingest.supervisor`).

    Not thread-safe; :meth:`run` must be called on the main thread (it
    installs SIGTERM / SIGINT handlers and restores them on return).
    """

    def __init__(self, template: ChildTemplate, *, restart: bool, until_idle: bool, join_grace_s: float,
                 restarts: policy.RestartPolicy, kill_after_s: float, poll_interval_s: float) -> None:
        self.template = template
        self.children = [Child(i) for i in range(template.processes)]
        self.restart = restart
        self.until_idle = until_idle
        self.join_grace_s = join_grace_s
        self.restarts = restarts
        self.kill_after_s = kill_after_s
        self.poll_interval_s = poll_interval_s
        self.stopping = False
        self.failure_code: int | None = None
        self.kill_deadline_s: float | None = None
        self._pending_signals: list[int] = []
        self._signals_seen = 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Supervise until no child runs or waits for a restart; the parent's exit code."""
        started_s = time.monotonic()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            log.info("starting worker processes", extra={"processes": len(self.children), "restart": self.restart})
            for c in self.children:
                c.start(self.template)
            while self.tick():
                time.sleep(self.poll_interval_s)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._stop_leftovers()
        code = self.exit_code()
        log.info("worker processes exited", extra={
            "exit_code": code, "children": [c.exit_code for c in self.children],
            "restarts": sum(c.restarts for c in self.children),
        })
        if self.template.summary_json is not None:
            write_summary(self.template.summary_json, [c.report() for c in self.children],
                          [c.summaries for c in self.children], time.monotonic() - started_s, code)
        return code

    def tick(self) -> bool:
        """One round: forward signals, reap exits, send deferred stops, restart, kill; False when done."""
        self._forward_signals()
        for c in self.children:
            rc = c.reap()
            if rc is not None:
                self._on_exit(c, rc)
        now_s = time.monotonic()
        for c in self.children:
            if c.alive and c.stop_wanted and not c.signalled and now_s - c.started_s >= self.join_grace_s:
                c.send(signal.SIGTERM)
            if not self.stopping and c.restart_at is not None and now_s >= c.restart_at:
                c.restarts += 1
                c.start(self.template)
        if self.kill_deadline_s is not None and now_s >= self.kill_deadline_s:
            self._kill_survivors()
        return any(c.alive or c.restart_at is not None for c in self.children)

    def exit_code(self) -> int:
        """The highest normalised code of the children's last incarnations and of the failure that stopped them."""
        return max([c.normalised_exit() for c in self.children] + [self.failure_code or 0])

    # ------------------------------------------------------------------ signals

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._pending_signals.append(signum)  # acted on by the loop, never inside the handler

    def _forward_signals(self) -> None:
        while self._pending_signals:
            sig = self._pending_signals.pop(0)
            self._signals_seen += 1
            name = signal.Signals(sig).name
            if self._signals_seen == 1:
                log.info("signal received: stopping every child", extra={"signal": name})
            else:
                log.warning("another signal: forwarding, children abort", extra={"signal": name})
                if self.kill_deadline_s is None:
                    self.kill_deadline_s = time.monotonic() + self.kill_after_s
            self.stopping = True
            for c in self.children:
                c.restart_at = None
                c.send(sig)

    def _kill_survivors(self) -> None:
        for c in self.children:
            if c.alive:
                log.error("child still running after abort: SIGKILL", extra={"child": c.index, "pid": c.pid})
                c.send(signal.SIGKILL)
                c.killed = True
        self.kill_deadline_s = None

    def _stop_leftovers(self) -> None:
        """Only on an error in the supervisor itself: SIGTERM every running child, then wait or kill."""
        leftovers = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for c in leftovers:
            c.send(signal.SIGTERM)
        for c in leftovers:
            c.wait_or_kill(self.kill_after_s)

    # ------------------------------------------------------------------ exits

    def _on_exit(self, c: Child, rc: int) -> None:
        c.collect_summary(self.template)
        extra = {"child": c.index, "pid": c.pid, "exit_code": rc, "how": policy.describe(rc)}
        if self.stopping:
            (log.info if rc in (0, policy.EXIT_ABORTED) else log.warning)("child exited", extra=extra)
            return
        if self.until_idle and rc == 0:
            log.info("child finished", extra=extra)
            return
        if self.restart and policy.is_restartable(rc):
            now_s = time.monotonic()
            delay_s = self.restarts.next_delay_s(c.deaths, now_s)
            if delay_s is None:
                log.error("child keeps dying: giving up, stopping the others",
                          extra={**extra, "deaths": len(c.deaths), "window_s": self.restarts.window_s})
                self._begin_failure_stop(policy.EXIT_FAILED)
                return
            c.restart_at = now_s + delay_s
            log.error("child died unexpectedly: restarting", extra={**extra, "in_s": round(delay_s, 3)})
            return
        code = policy.failure_code(rc)
        log.error("child failed: stopping the others", extra={**extra, "parent_exit_code": code})
        self._begin_failure_stop(code)

    def _begin_failure_stop(self, code: int) -> None:
        if self.failure_code is None:
            self.failure_code = code
        self.stopping = True
        for other in self.children:
            other.restart_at = None
            if other.alive:
                other.stop_wanted = True  # signalled by tick() once past join_grace_s


def supervise(
    argv_for_child: Sequence[str],
    processes: int,
    *,
    restart: bool,
    until_idle: bool = False,
    metrics_port: int | None = None,
    summary_json: Path | None = None,
    join_grace_s: float = 0.0,
    max_restarts: int = 5,
    restart_window_s: float = 60.0,
    backoff_s: float = 1.0,
    max_backoff_s: float = 30.0,
    kill_after_s: float = 15.0,
    env: Mapping[str, str] | None = None,
    poll_interval_s: float = 0.1,
) -> int:
    """Run ``processes`` copies of ``argv_for_child`` until they finish or are stopped; return the exit code.

    ``argv_for_child`` is the whole command (``[python, -m, ingest, run, ...]``);
    per child the parent appends ``--metrics-port`` (when ``metrics_port`` is
    not None) and ``--summary-json`` (when ``summary_json`` is set). Must run
    on the main thread. See :mod:`ingest.supervisor` for the policy.
    """
    if processes < 1:
        raise ValueError("processes must be >= 1")
    template = ChildTemplate(argv_for_child, processes, dict(os.environ if env is None else env),
                             metrics_port, summary_json)
    restarts = policy.RestartPolicy(max_restarts, restart_window_s, backoff_s, max_backoff_s)
    return Supervisor(template, restart=restart, until_idle=until_idle, join_grace_s=join_grace_s,
                      restarts=restarts, kill_after_s=kill_after_s, poll_interval_s=poll_interval_s).run()


def run_from_cli(settings: Any, processes: int, *, argv: Sequence[str] | None = None, until_idle: bool,
                 metrics_port: int, summary_json: Path | None) -> int:
    """The ``ingest run --processes P`` entry point (config already validated by the caller)."""
    return supervise(
        child_argv(sys.argv if argv is None else argv), processes, restart=True, until_idle=until_idle,
        metrics_port=metrics_port, summary_json=summary_json,
        join_grace_s=join_grace_from_client(settings.kafka.client),
    )
