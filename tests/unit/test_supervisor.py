"""The ``--processes`` supervisor's signal, restart and exit policy, with fake child commands.

The supervisor runs in its own subprocess (it installs signal handlers, so it
must own a main thread); its children are a tiny Python script whose
behaviour per process index and incarnation comes from ``FAKE_PLAN``:

- ``run``       run until a signal, then exit 0 (130 on a second signal);
- ``slow``      ignore the first signal; exit 130 on the second;
- ``exit:N``    exit N after 0.3 s;
- ``kill``      SIGKILL itself after 0.3 s.

Each child appends what happened to ``<state>/<index>.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from ingest.supervisor import child_argv, join_grace_from_client, merge_summaries

pytestmark = pytest.mark.timeout(60)

FAKE_CHILD = r"""
import json, os, signal, sys, time
from pathlib import Path
idx = int(os.environ["INGEST_PROCESS_INDEX"])
state = Path(os.environ["FAKE_STATE"])
steps = json.loads(os.environ["FAKE_PLAN"]).get(str(idx), ["run"])
count = state / f"{idx}.count"
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
step = steps[min(n, len(steps) - 1)]
log = open(state / f"{idx}.log", "a", buffering=1)
env = {k: os.environ.get(k) for k in ("INGEST_PROCESSES", "INGEST_PROCESS_COUNT")}
log.write(json.dumps({"start": n, "t": time.time(), "pid": os.getpid(), "pgid": os.getpgid(0),
                      "argv": sys.argv[1:], "env": env}) + "\n")
got = []
def on(sig, _frame):
    got.append(sig)
    log.write(json.dumps({"signal": signal.Signals(sig).name, "t": time.time()}) + "\n")
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGINT, on)
def leave(code):
    if "--summary-json" in sys.argv:
        path = sys.argv[sys.argv.index("--summary-json") + 1]
        Path(path).write_text(json.dumps({"elapsed_s": 1.0, "peak_rss_bytes": 100, "errors": {},
            "pipelines": {"orders": {"records_consumed": 10 + idx, "paused_s": 0.5,
                                     "flushes": {"size": 1 + idx}, "busy_s": 1.0 + idx}}}))
    log.write(json.dumps({"exit": code}) + "\n")
    sys.exit(code)
kind, _, arg = step.partition(":")
began = time.monotonic()
while True:
    if kind == "exit" and time.monotonic() - began > 0.3:
        leave(int(arg))
    if kind == "kill" and time.monotonic() - began > 0.3:
        os.kill(os.getpid(), signal.SIGKILL)
    if got and not (kind == "slow" and len(got) < 2):
        leave(130 if len(got) >= 2 else 0)
    time.sleep(0.02)
"""

SUPERVISOR = (
    "import json, sys\n"
    "from ingest.logs import setup_logging\n"
    "from ingest.supervisor import supervise\n"
    "setup_logging('info', json_output=True)\n"
    "kw = json.loads(sys.argv[1])\n"
    "sys.exit(supervise(kw.pop('argv'), kw.pop('processes'), **kw))\n"
)


class Run:
    """A supervisor subprocess (own process group) over fake children."""

    def __init__(self, tmp_path: Path, processes: int, plan: dict[int, list[str]], **kwargs) -> None:
        self.state = tmp_path / "state"
        self.state.mkdir()
        self.processes = processes
        kw = {"argv": [sys.executable, "-c", FAKE_CHILD], "processes": processes, "restart": True,
              "backoff_s": 0.05, "poll_interval_s": 0.02, **kwargs}
        env = {**os.environ, "FAKE_STATE": str(self.state), "INGEST_PROCESSES": "7",
               "FAKE_PLAN": json.dumps({str(k): v for k, v in plan.items()})}
        env.pop("INGEST_PROCESS_INDEX", None)
        self.stderr_path = tmp_path / "supervisor.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, json.dumps(kw)], env=env,
                                         stdin=subprocess.DEVNULL, stderr=err, process_group=0)

    def events(self, index: int) -> list[dict]:
        path = self.state / f"{index}.log"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def starts(self, index: int) -> list[dict]:
        return [e for e in self.events(index) if "start" in e]

    def signals(self, index: int) -> list[str]:
        return [e["signal"] for e in self.events(index) if "signal" in e]

    def exits(self, index: int) -> list[int]:
        return [e["exit"] for e in self.events(index) if "exit" in e]

    def wait_started(self, count: int = 1, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(len(self.starts(i)) >= count for i in range(self.processes)):
            assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode}\n{self.log()}"
            assert time.monotonic() < deadline, f"children did not start\n{self.log()}"
            time.sleep(0.02)

    def wait(self, timeout_s: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"supervisor did not exit\n{self.log()}") from None

    def log(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def log_events(self) -> list[dict]:
        return [json.loads(line) for line in self.log().splitlines() if line.startswith("{")]

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for i in range(self.processes):
            for s in self.starts(i):
                try:
                    os.kill(s["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def make_run(tmp_path):
    runs: list[Run] = []

    def factory(*args, **kwargs) -> Run:
        run = Run(tmp_path, *args, **kwargs)
        runs.append(run)
        return run

    yield factory
    for run in runs:
        run.kill_all()


def test_ctrl_c_to_the_foreground_group_reaches_each_child_exactly_once(make_run, tmp_path):
    summary = tmp_path / "summary.json"
    run = make_run(3, {}, metrics_port=9500, summary_json=str(summary))
    run.wait_started()
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    assert run.wait() == 0, run.log()
    for i in range(3):
        assert run.signals(i) == ["SIGINT"], (i, run.events(i))  # once: forwarded, not also from the tty
        assert run.exits(i) == [0]
        start = run.starts(i)[0]
        assert start["pgid"] != run.proc.pid  # children live in their own process groups
        argv = start["argv"]
        assert argv[argv.index("--metrics-port") + 1] == str(9500 + i)
        assert argv[argv.index("--summary-json") + 1] == f"{summary}.{i}"
        assert start["env"] == {"INGEST_PROCESSES": "1", "INGEST_PROCESS_COUNT": "3"}
    doc = json.loads(summary.read_text())
    assert doc["exit_code"] == 0
    assert doc["pipelines"]["orders"]["records_consumed"] == 10 + 11 + 12
    assert doc["pipelines"]["orders"]["flushes"] == {"size": 6}
    assert doc["pipelines"]["orders"]["busy_s"] == 3.0  # the longest, not the sum
    assert doc["peak_rss_bytes"] == 300
    assert [p["exit_code"] for p in doc["processes"]] == [0, 0, 0]
    assert [p["summary"]["pipelines"]["orders"]["records_consumed"] for p in doc["processes"]] == [10, 11, 12]


def test_metrics_port_zero_stays_off_for_every_child(make_run):
    run = make_run(2, {}, metrics_port=0)
    run.wait_started()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()
    for i in range(2):
        argv = run.starts(i)[0]["argv"]
        assert argv[argv.index("--metrics-port") + 1] == "0"
        assert "--summary-json" not in argv


def test_second_signal_is_forwarded_and_children_abort(make_run):
    run = make_run(2, {0: ["slow"], 1: ["slow"]})
    run.wait_started()
    run.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert run.proc.poll() is None, "the parent must wait for its children"
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 130, run.log()
    for i in range(2):
        assert run.signals(i) == ["SIGTERM", "SIGTERM"]
        assert run.exits(i) == [130]


def test_children_not_exiting_after_abort_are_killed(make_run):
    # "slow" children exit on a second signal; a third-party SIGSTOP keeps one from ever running.
    run = make_run(2, {}, kill_after_s=1.0)
    run.wait_started()
    os.kill(run.starts(0)[0]["pid"], signal.SIGSTOP)
    run.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 130, run.log()
    assert any(e.get("event") == "child still running after abort: SIGKILL" for e in run.log_events())


def test_a_killed_child_is_restarted_under_the_same_index(make_run):
    run = make_run(2, {1: ["kill", "run"]}, metrics_port=9600)
    run.wait_started(count=1)
    deadline = time.monotonic() + 15
    while len(run.starts(1)) < 2:
        assert time.monotonic() < deadline and run.proc.poll() is None, run.log()
        time.sleep(0.05)
    assert len(run.starts(0)) == 1 and run.signals(0) == []  # the sibling is untouched
    again = run.starts(1)[1]["argv"]
    assert again[again.index("--metrics-port") + 1] == "9601"
    time.sleep(0.3)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()  # stopped cleanly: the earlier death was repaired
    assert run.exits(0) == [0] and run.exits(1) == [0]
    died = [e for e in run.log_events() if e.get("event") == "child died unexpectedly: restarting"]
    assert [(e["child"], e["how"]) for e in died] == [(1, "killed by SIGKILL")]


def test_a_crash_loop_gives_up_and_stops_the_others(make_run):
    run = make_run(2, {0: ["kill"]}, max_restarts=2, restart_window_s=60)
    assert run.wait() == 1, run.log()
    assert len(run.starts(0)) == 3  # the first run and 2 restarts
    assert run.signals(1) == ["SIGTERM"] and run.exits(1) == [0]


def test_without_restart_a_killed_child_stops_the_others_and_the_parent_fails(make_run):
    run = make_run(2, {0: ["kill"]}, restart=False)
    assert run.wait() == 1, run.log()
    assert len(run.starts(0)) == 1
    assert run.signals(1) == ["SIGTERM"] and run.exits(1) == [0]


@pytest.mark.parametrize(("code", "parent"), [(1, 1), (2, 2), (3, 3), (7, 1)])
def test_a_failed_child_is_not_restarted_and_its_code_is_kept(make_run, code, parent):
    run = make_run(2, {0: [f"exit:{code}"]})
    assert run.wait() == parent, run.log()
    assert len(run.starts(0)) == 1
    assert run.signals(1) == ["SIGTERM"] and run.exits(1) == [0]


def test_a_sibling_still_joining_gets_its_stop_only_after_the_join_grace(make_run):
    grace = 2.0
    run = make_run(2, {0: ["exit:3"]}, join_grace_s=grace)
    assert run.wait() == 3, run.log()
    # the age counts from the supervisor's Popen (its log line), not from the child's first line
    started = next(_ts(e) for e in run.log_events() if e.get("event") == "child started" and e["child"] == 1)
    signalled = next(e["t"] for e in run.events(1) if "signal" in e)
    assert signalled - started >= grace - 0.05, "the supervisor signalled a child that may still be joining"
    assert signalled - started < grace + 2


def _ts(event: dict) -> float:
    return datetime.strptime(event["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def test_a_user_signal_is_not_delayed_by_the_join_grace(make_run):
    run = make_run(2, {}, join_grace_s=30.0)
    run.wait_started()
    sent = time.time()
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(10) == 0, run.log()
    for i in range(2):
        got = next(e["t"] for e in run.events(i) if "signal" in e)
        assert got - sent < 2.0


def test_until_idle_parent_exits_when_all_children_finished(make_run):
    run = make_run(3, {0: ["exit:0"], 1: ["exit:0"], 2: ["exit:0"]}, until_idle=True)
    assert run.wait() == 0, run.log()
    for i in range(3):
        assert len(run.starts(i)) == 1 and run.signals(i) == [] and run.exits(i) == [0]


def test_until_idle_a_failing_child_gives_the_worst_code(make_run):
    run = make_run(2, {0: ["exit:0"], 1: ["exit:2"]}, until_idle=True)
    assert run.wait() == 2, run.log()
    # Child 0 finishes with 0 whether it exits first or is stopped by the parent after child 1 failed
    # (which of the two happens first is a race between two processes; either is correct).
    assert run.exits(0) == [0], run.log()


def test_without_until_idle_a_child_exiting_0_on_its_own_is_restarted(make_run):
    run = make_run(2, {0: ["exit:0", "run"]})
    deadline = time.monotonic() + 15
    while len(run.starts(0)) < 2:
        assert time.monotonic() < deadline and run.proc.poll() is None, run.log()
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 0, run.log()


def test_children_get_sigterm_when_the_parent_is_sigkilled(make_run):
    run = make_run(2, {})
    run.wait_started()
    run.proc.kill()
    run.proc.wait(5)
    deadline = time.monotonic() + 10
    while not all(run.exits(i) == [0] for i in range(2)):
        assert time.monotonic() < deadline, [run.events(i) for i in range(2)]
        time.sleep(0.05)
    assert all(run.signals(i) == ["SIGTERM"] for i in range(2))


# --------------------------------------------------------------------------- pure helpers


def test_child_argv_drops_the_per_child_options():
    argv = ["/x/bin/ingest", "run", "--config", "c.yaml", "--processes", "4", "--metrics-port=9000",
            "--summary-json", "s.json", "-p", "orders", "--until-idle", "3"]
    assert child_argv(argv) == [sys.executable, "-m", "ingest", "run", "--config", "c.yaml", "-p", "orders",
                                "--until-idle", "3"]
    assert child_argv(["ingest", "run", "--processes=2"]) == [sys.executable, "-m", "ingest", "run"]


def test_join_grace_follows_the_session_timeout():
    assert join_grace_from_client({"session.timeout.ms": 6000}) == 6.0
    assert join_grace_from_client({}) == 45.0
    assert join_grace_from_client({"session.timeout.ms": 300_000}) == 60.0


def test_merge_summaries_sums_counters_and_names_the_failing_process():
    merged = merge_summaries([
        {"_index": 0, "peak_rss_bytes": 5, "errors": {},
         "pipelines": {"a": {"rows_written": 3, "dead_lettered_by_class": {"x/y": 1}}}},
        {"_index": 1, "peak_rss_bytes": 7, "errors": {"a": "boom"},
         "pipelines": {"a": {"rows_written": 4, "dead_lettered_by_class": {"x/y": 2}}}},
    ])
    assert merged == {"pipelines": {"a": {"rows_written": 7, "dead_lettered_by_class": {"x/y": 3}}},
                      "errors": {"a": "process 1: boom"}, "peak_rss_bytes": 12}


def test_merge_summaries_spans_the_processes_busy_windows() -> None:
    """busy_s of the merge = earliest first record to latest last batch, across processes."""
    def child(window: list[float | None], busy: float) -> dict[str, object]:
        return {"pipelines": {"p": {"records_consumed": 10, "busy_s": busy, "busy_window_s": window}}}

    doc = merge_summaries([child([100.0, 103.0], 3.0), child([101.5, 104.25], 2.75), child([None, None], 0.0)])
    assert doc["pipelines"]["p"]["busy_window_s"] == [100.0, 104.25]
    assert doc["pipelines"]["p"]["busy_s"] == 4.25  # not the longest single window (3.0)
    assert doc["pipelines"]["p"]["records_consumed"] == 30
