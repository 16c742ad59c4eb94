"""``ingest run --processes P``: P worker processes in one consumer group.

The parent starts P children, ``python -m ingest run <the same arguments>``
(minus ``--processes``), and supervises them. Each child is an ordinary,
complete ``ingest run``: it joins the configured consumer groups, and Kafka's
group protocol spreads the partitions over the children exactly as it would
over P containers. The parent consumes nothing, opens no broker or database
connection and serves no port; it only starts, signals and reaps.

Children are started with :mod:`subprocess` (fork + exec of a fresh
interpreter), never ``multiprocessing`` fork: librdkafka and the lane threads
do not survive a fork.

What each child gets
--------------------
- env ``INGEST_PROCESS_INDEX`` = 0..P-1 (stable across restarts; every JSON log
  line of the child carries it as ``"process"``), ``INGEST_PROCESS_COUNT`` = P,
  and ``INGEST_PROCESSES=1`` (a child never supervises);
- its own metrics port: ``--metrics-port`` base + index when the base is
  non-zero (default 9464 → 9464, 9465, ...), so every child keeps its own
  ``/metrics``, ``/healthz`` and ``/readyz`` (scrape P ports); 0 stays 0 (off)
  for all. A port already taken only costs that child its endpoint (logged);
- ``--summary-json PATH.<index>`` when the parent has ``--summary-json PATH``;
  the parent then writes PATH itself: the pipelines' counters summed over all
  children (and all incarnations of a restarted child) plus a ``processes``
  list with each child's exit code, restarts and own summary;
- stdin from /dev/null; stdout/stderr inherited (one stream, lines tagged by
  ``"process"``);
- its own process group, so a terminal's Ctrl-C reaches only the parent,
  which forwards it once (otherwise every child would see the signal twice:
  once from the terminal, once forwarded, and abort);
- ``PR_SET_PDEATHSIG = SIGTERM`` (Linux): if the parent is SIGKILLed, every
  child still gets a SIGTERM and stops cleanly with its final commit.

Signals
-------
SIGTERM / SIGINT to the parent is forwarded at once to every running child
(each stops fetching, flushes, commits, exits 0 — see ``ingest.cli.run``); a
pending restart is cancelled. A second signal is forwarded again: the children
abort (exit 130). If children are still alive ``kill_after_s`` after the
second signal, they are SIGKILLed (nothing unwritten is committed either way).
User signals are never delayed, even for a child still joining its group:
a stop request must be prompt, and a single process would stop the same way.

Exit and restart policy
-----------------------
A child *dies unexpectedly* when it exits while the parent is not stopping
and it was not a normal ``--until-idle`` finish (exit 0). Then:

- **killed by a signal** (OOM killer, SIGKILL, a segfault), or exit 0 / 130
  without ``--until-idle`` (someone signalled the child directly): with
  ``restart=True`` (the CLI's choice) it is restarted under the same index,
  after a backoff of ``backoff_s`` doubling per recent death up to
  ``max_backoff_s``. Its uncommitted records are re-read by whichever member
  gets its partitions (at-least-once, idempotent upserts), so a restart loses
  nothing. More than ``max_restarts`` deaths of one child within
  ``restart_window_s`` is a crash loop: the parent gives up, stops the others
  and exits 1 (the orchestrator sees it). With ``restart=False`` such a death
  stops the others and exits 1.
- **exit 1, 2, 3 or any other code**: the child reported a failure that a
  restart would only repeat (retries exhausted, DLQ guard tripped — which
  exists to stop the pipeline for a human —, invalid configuration, a service
  unreachable at start, an unexpected exception). As in a single process where
  one failed pipeline stops the others: the parent stops the other children
  cleanly and exits with that code (2 and 3 kept, anything else 1).

A supervisor-initiated stop (after a failure) spares children that may still
be joining their group: a child younger than ``join_grace_s`` gets its SIGTERM
once it reaches that age (the CLI derives it from the consumer's
``session.timeout.ms``). On some brokers (the Tansu test broker) a consumer
that leaves before its first assignment wedges the group; Apache Kafka copes,
but nothing is lost by waiting.

Exit code: once every child has exited, the highest exit code among the
children's last incarnations (a death by signal counts as 1, or 130 when the
parent SIGKILLed it after an abort; codes other than 0/1/2/3/130 count as 1;
a child whose restart was cancelled by a stop keeps its death, 1) and the failure code that
started a supervisor stop, if any. So 0 when every child stopped cleanly, 130
when a second signal aborted them. With ``--until-idle`` the parent exits when
all children have finished.
"""

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

log = logging.getLogger(__name__)

EXIT_FAILED, EXIT_CONFIG, EXIT_UNREACHABLE, EXIT_ABORTED = 1, 2, 3, 130
_KEPT_CODES = (EXIT_CONFIG, EXIT_UNREACHABLE)
_PR_SET_PDEATHSIG = 1
#: Options the parent sets per child (removed from the parent's argv when building the child's).
PER_CHILD_OPTIONS = ("--processes", "--metrics-port", "--summary-json")
_DEFAULT_SESSION_TIMEOUT_MS = 45_000  # ingest.sources.kafka's default


@dataclass
class _Child:
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
        return self.proc is not None


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


def run_from_cli(settings: Any, processes: int, *, argv: Sequence[str] | None = None, until_idle: bool,
                 metrics_port: int, summary_json: Path | None) -> int:
    """The ``ingest run --processes P`` entry point (config already validated by the caller)."""
    return supervise(
        child_argv(sys.argv if argv is None else argv), processes, restart=True, until_idle=until_idle,
        metrics_port=metrics_port, summary_json=summary_json,
        join_grace_s=join_grace_from_client(settings.kafka.client),
    )


def _die_with_parent(parent_pid: int) -> Any:
    def preexec() -> None:  # runs in the child between fork and exec
        if sys.platform.startswith("linux"):
            with contextlib.suppress(Exception):
                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(EXIT_FAILED)

    return preexec


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def _norm(c: _Child) -> int:
    if c.exit_code is None:
        return 0
    if c.exit_code < 0:
        return EXIT_ABORTED if c.killed else EXIT_FAILED
    return c.exit_code if c.exit_code in (0, EXIT_FAILED, *_KEPT_CODES, EXIT_ABORTED) else EXIT_FAILED


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
    on the main thread (it installs SIGTERM / SIGINT handlers, restored on
    return). See the module docstring for the policy.
    """
    if processes < 1:
        raise ValueError("processes must be >= 1")
    base_env = dict(os.environ if env is None else env)
    children = [_Child(i) for i in range(processes)]
    pending_signals: list[int] = []
    signals_seen = 0
    stopping = False
    failure_code: int | None = None
    kill_deadline: float | None = None
    started = time.monotonic()
    parent_pid = os.getpid()

    def summary_path(c: _Child) -> Path | None:
        return None if summary_json is None else Path(f"{summary_json}.{c.index}")

    def start(c: _Child) -> None:
        cmd = list(argv_for_child)
        if metrics_port is not None:
            cmd += ["--metrics-port", str(metrics_port + c.index if metrics_port else 0)]
        path = summary_path(c)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # never merge a stale file
            cmd += ["--summary-json", str(path)]
        child_env = {**base_env, "INGEST_PROCESS_INDEX": str(c.index), "INGEST_PROCESS_COUNT": str(processes),
                     "INGEST_PROCESSES": "1"}
        c.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            cmd, stdin=subprocess.DEVNULL, env=child_env, process_group=0,
            preexec_fn=_die_with_parent(parent_pid),  # noqa: PLW1509 - the parent is single-threaded here
        )
        c.pid = c.proc.pid
        c.started_s = time.monotonic()
        c.signalled = False
        c.restart_at = None
        log.info("child started", extra={"child": c.index, "pid": c.pid, "restarts": c.restarts})

    def send(c: _Child, sig: int) -> None:
        if c.proc is not None and c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(sig)
            c.signalled = True

    def collect_summary(c: _Child) -> None:
        path = summary_path(c)
        if path is None:
            return
        try:
            import orjson

            c.summaries.append(orjson.loads(path.read_bytes()))
        except (OSError, ValueError):
            pass  # a killed child writes none

    def begin_failure_stop(code: int) -> None:
        nonlocal stopping, failure_code
        if failure_code is None:
            failure_code = code
        stopping = True
        for other in children:
            other.restart_at = None
            if other.alive:
                other.stop_wanted = True

    def on_exit(c: _Child, rc: int) -> None:
        c.proc = None
        c.exit_code = rc
        collect_summary(c)
        extra = {"child": c.index, "pid": c.pid, "exit_code": rc, "how": _describe(rc)}
        if stopping:
            (log.info if rc in (0, EXIT_ABORTED) else log.warning)("child exited", extra=extra)
            return
        if until_idle and rc == 0:
            log.info("child finished", extra=extra)
            return
        restartable = rc < 0 or rc == EXIT_ABORTED or rc == 0
        if restart and restartable:
            now = time.monotonic()
            c.deaths.append(now)
            while c.deaths and now - c.deaths[0] > restart_window_s:
                c.deaths.popleft()
            if len(c.deaths) > max_restarts:
                log.error("child keeps dying: giving up, stopping the others",
                          extra={**extra, "deaths": len(c.deaths), "window_s": restart_window_s})
                begin_failure_stop(EXIT_FAILED)
                return
            delay = min(max_backoff_s, backoff_s * 2 ** (len(c.deaths) - 1))
            c.restart_at = now + delay
            log.error("child died unexpectedly: restarting", extra={**extra, "in_s": round(delay, 3)})
            return
        code = rc if rc in _KEPT_CODES else EXIT_FAILED
        log.error("child failed: stopping the others", extra={**extra, "parent_exit_code": code})
        begin_failure_stop(code)

    def on_signal(signum: int, _frame: Any) -> None:
        pending_signals.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        log.info("starting worker processes", extra={"processes": processes, "restart": restart})
        for c in children:
            start(c)
        while True:
            while pending_signals:
                sig = pending_signals.pop(0)
                signals_seen += 1
                name = signal.Signals(sig).name
                if signals_seen == 1:
                    log.info("signal received: stopping every child", extra={"signal": name})
                else:
                    log.warning("another signal: forwarding, children abort", extra={"signal": name})
                    if kill_deadline is None:
                        kill_deadline = time.monotonic() + kill_after_s
                stopping = True
                for c in children:
                    c.restart_at = None
                    send(c, sig)
            for c in children:
                if c.proc is not None:
                    rc = c.proc.poll()
                    if rc is not None:
                        on_exit(c, rc)
            now = time.monotonic()
            for c in children:
                if c.alive and c.stop_wanted and not c.signalled and now - c.started_s >= join_grace_s:
                    send(c, signal.SIGTERM)
                if not stopping and c.restart_at is not None and now >= c.restart_at:
                    c.restarts += 1
                    start(c)
            if kill_deadline is not None and now >= kill_deadline:
                for c in children:
                    if c.alive:
                        log.error("child still running after abort: SIGKILL", extra={"child": c.index, "pid": c.pid})
                        send(c, signal.SIGKILL)
                        c.killed = True
                kill_deadline = None
            if not any(c.alive or c.restart_at is not None for c in children):
                break
            time.sleep(poll_interval_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        leftovers = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for c in leftovers:  # only on an error in the supervisor itself
            send(c, signal.SIGTERM)
        for c in leftovers:
            assert c.proc is not None
            try:
                c.proc.wait(kill_after_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    code = max([_norm(c) for c in children] + [failure_code or 0])
    log.info("worker processes exited", extra={
        "exit_code": code, "children": [c.exit_code for c in children],
        "restarts": sum(c.restarts for c in children),
    })
    if summary_json is not None:
        _write_summary(summary_json, children, time.monotonic() - started, code)
    return code


# --------------------------------------------------------------------------- summary


def _add(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Sum numbers, merge nested dicts, concatenate lists; other values: the last one.

    ``busy_window_s`` (first record, last batch on the system-wide monotonic clock)
    merges into the earliest start and the latest end, and ``busy_s`` becomes
    that window's length (all processes together), or the longest ``busy_s``
    when a child gave no window.
    """
    for k, v in other.items():
        cur = into.get(k)
        if k == "busy_window_s":
            into[k] = _merge_window(cur, v)
            if into[k] is not None and None not in into[k]:
                into["busy_s"] = round(into[k][1] - into[k][0], 3)
            continue
        if k == "busy_s" and into.get("busy_window_s") is not None:
            continue
        if isinstance(v, list):
            into[k] = [*(cur if isinstance(cur, list) else []), *v]
        elif isinstance(v, bool) or not isinstance(v, (int, float, dict)):
            into[k] = v
        elif isinstance(v, dict):
            if not isinstance(cur, dict):
                cur = into[k] = {}
            _add(cur, v)
        elif k == "busy_s":
            into[k] = max(cur or 0, v)
        else:
            into[k] = round((cur or 0) + v, 3) if isinstance(v, float) or isinstance(cur, float) else (cur or 0) + v


def _merge_window(a: Sequence[float | None] | None, b: Sequence[float | None] | None) -> list[float | None] | None:
    """The union span of two (start, end) windows; a missing side or end is ignored."""
    windows = [w for w in (a, b) if w is not None and None not in w]
    if not windows:
        return list(a) if a is not None else (list(b) if b is not None else None)
    return [min(w[0] for w in windows), max(w[1] for w in windows)]  # type: ignore[type-var]


def merge_summaries(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One ``--summary-json`` document from the children's: counters summed, errors prefixed by index."""
    pipelines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    rss = 0
    for s in summaries:
        for name, stats in (s.get("pipelines") or {}).items():
            _add(pipelines.setdefault(name, {}), stats)
        rss += int(s.get("peak_rss_bytes") or 0)
        idx = s.get("_index")
        for name, msg in (s.get("errors") or {}).items():
            text = f"process {idx}: {msg}" if idx is not None else str(msg)
            errors[name] = f"{errors[name]}; {text}" if name in errors else text
    return {"pipelines": pipelines, "errors": errors, "peak_rss_bytes": rss}


def _write_summary(path: Path, children: Sequence[_Child], elapsed: float, code: int) -> None:
    import orjson

    tagged = [{**s, "_index": c.index} for c in children for s in c.summaries]
    merged = merge_summaries(tagged)
    doc = {
        "elapsed_s": round(elapsed, 3),
        # the sum of the children's peaks (an upper bound of the footprint at any moment)
        "peak_rss_bytes": merged["peak_rss_bytes"],
        "pipelines": merged["pipelines"],
        "errors": merged["errors"],
        "exit_code": code,
        "processes": [
            {"index": c.index, "pid": c.pid, "exit_code": c.exit_code, "restarts": c.restarts,
             "summary": c.summaries[-1] if c.summaries else None}
            for c in children
        ],
    }
    try:
        Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    except OSError as exc:
        log.error("cannot write the summary", extra={"path": str(path), "error": str(exc)})
