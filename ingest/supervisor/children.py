"""One worker process: its command line, environment, start and signals."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ingest.supervisor.policy import EXIT_FAILED, normalised_exit
from ingest.supervisor.summary import read_summary

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: Options the parent sets per child (removed from the parent's argv when building the child's).
PER_CHILD_OPTIONS = ("--processes", "--metrics-port", "--summary-json")
_DEFAULT_SESSION_TIMEOUT_MS = 45_000  # ingest.sources.kafka's default


def child_argv(argv: Sequence[str], drop: Sequence[str] = PER_CHILD_OPTIONS) -> list[str]:
    """``[python, -m, ingest, *argv[1:]]`` without the options in ``drop`` (and their values).

    ``argv`` is the parent's ``sys.argv``; both ``--opt value`` and ``--opt=value`` are removed.
    """
    out: list[str] = []
    args = list(argv[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out.extend(args[i:])
            break
        if a in drop:
            i += 2
            continue
        if any(a.startswith(opt + "=") for opt in drop):
            i += 1
            continue
        out.append(a)
        i += 1
    return [sys.executable, "-m", "ingest", *out]


def join_grace_from_client(client: Mapping[str, Any]) -> float:
    """How long a new child may still be joining its group: its ``session.timeout.ms``.

    A join takes about half of it on the Tansu broker and a few seconds on
    Kafka; capped at 60 s.
    """
    try:
        ms = float(client.get("session.timeout.ms", _DEFAULT_SESSION_TIMEOUT_MS))
    except (TypeError, ValueError):
        ms = _DEFAULT_SESSION_TIMEOUT_MS
    return min(60.0, max(0.0, ms / 1000))


def _die_with_parent(parent_pid: int) -> Any:
    def preexec() -> None:  # runs in the child between fork and exec
        if sys.platform.startswith("linux"):
            with contextlib.suppress(Exception):
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(EXIT_FAILED)

    return preexec


@dataclass(frozen=True)
class ChildTemplate:
    """What every child shares: the command, the environment, the per-child option bases."""

    argv: Sequence[str]
    processes: int
    env: Mapping[str, str]
    metrics_port: int | None = None
    summary_json: Path | None = None

    def summary_path(self, index: int) -> Path | None:
        """Child ``index``'s ``--summary-json`` file: ``PATH.<index>``."""
        return None if self.summary_json is None else Path(f"{self.summary_json}.{index}")

    def command(self, index: int) -> list[str]:
        """The child's command line: the shared one plus its metrics port and summary file."""
        cmd = list(self.argv)
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port + index if self.metrics_port else 0)]
        path = self.summary_path(index)
        if path is not None:
            cmd += ["--summary-json", str(path)]
        return cmd

    def environment(self, index: int) -> dict[str, str]:
        """The child's environment: the shared one plus its index, the count, and "never supervise"."""
        return {**self.env, "INGEST_PROCESS_INDEX": str(index), "INGEST_PROCESS_COUNT": str(self.processes),
                "INGEST_PROCESSES": "1"}


@dataclass
class Child:
    """One worker slot (stable index) across its incarnations."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0
    pid: int | None = None
    exit_code: int | None = None  # return code of the last incarnation
    restarts: int = 0
    deaths: collections.deque[float] = field(default_factory=collections.deque)
    restart_at: float | None = None
    stop_wanted: bool = False  # the supervisor wants it stopped (deferred by join_grace_s)
    signalled: bool = False  # a stop signal was sent to the current incarnation
    killed: bool = False  # SIGKILLed by the parent after an abort (counts as 130)
    summaries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        """An incarnation is running (or exited and not yet reaped)."""
        return self.proc is not None

    def start(self, template: ChildTemplate) -> None:
        """Start a new incarnation (own process group, stdin /dev/null, dies with the parent)."""
        path = template.summary_path(self.index)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # never merge a stale file
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            template.command(self.index), stdin=subprocess.DEVNULL, env=template.environment(self.index),
            process_group=0,
            preexec_fn=_die_with_parent(os.getpid()),  # noqa: PLW1509 - the parent is single-threaded here
        )
        self.pid = self.proc.pid
        self.started_s = time.monotonic()
        self.signalled = False
        self.restart_at = None
        log.info("child started", extra={"child": self.index, "pid": self.pid, "restarts": self.restarts})

    def send(self, sig: int) -> None:
        """Signal the running incarnation, if any (a race with its exit is harmless)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            self.signalled = True

    def reap(self) -> int | None:
        """The return code if the incarnation has exited (then it is forgotten), else None."""
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is not None:
            self.proc = None
            self.exit_code = rc
        return rc

    def collect_summary(self, template: ChildTemplate) -> None:
        """Keep the summary the exited incarnation wrote (a killed one writes none)."""
        path = template.summary_path(self.index)
        doc = None if path is None else read_summary(path)
        if doc is not None:
            self.summaries.append(doc)

    def wait_or_kill(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the incarnation to exit, then SIGKILL it (the supervisor's own errors only)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def normalised_exit(self) -> int:
        """What this child contributes to the parent's exit code (see :func:`policy.normalised_exit`)."""
        return normalised_exit(self.exit_code, killed_by_parent=self.killed)

    def report(self) -> dict[str, Any]:
        """The child's line in the parent's summary."""
        return {"index": self.index, "pid": self.pid, "exit_code": self.exit_code, "restarts": self.restarts}
