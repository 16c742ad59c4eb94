"""Chaos cases against the real broker and PostgreSQL (see runner.py for what each checks).

The short version runs by default (all cases together in about 4 minutes on a
2-core machine); ``INGEST_CHAOS_LONG=1`` runs the long one (>= 10 SIGKILLs,
bigger streams, more rounds of every fault). ``INGEST_CHAOS_SEED`` replays a
seed. Each test prints its row of the summary table; the whole table is printed
at the end of the session.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Loaded under a unique name: a top-level module called "runner" could clash with others on sys.path.
_spec = importlib.util.spec_from_file_location("ingest_chaos_runner", Path(__file__).with_name("runner.py"))
assert _spec is not None and _spec.loader is not None
chaos = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = chaos
_spec.loader.exec_module(chaos)

LONG = os.environ.get("INGEST_CHAOS_LONG", "").strip().lower() in {"1", "true", "yes", "on"}

# One worker runs every case (pytest-xdist --dist loadgroup): they share the summary table, and two
# chaos cases at once would starve each other's kill schedules on a 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800 if LONG else 240), pytest.mark.xdist_group("chaos")]


class _TablePrinter:
    """Prints the summary table of every case run in this session at the end."""

    def __init__(self) -> None:
        self.results: list = []

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.results:
            terminalreporter.write_sep("-", f"chaos summary ({'long' if LONG else 'short'} version)")
            for line in chaos.render_table(self.results).splitlines():
                terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def chaos_results(request: pytest.FixtureRequest) -> Iterator[list]:
    printer = _TablePrinter()
    request.config.pluginmanager.register(printer, "ingest-chaos-table")
    yield printer.results


@pytest.fixture
def chaos_env(kafka_bootstrap: str, pg_admin_dsn: str, request: pytest.FixtureRequest) -> "chaos.ChaosEnv":
    # Not tmp_path: pytest keeps only the last few of those, and a failed case's ingest logs are what
    # a diagnosis needs. _check removes the directory when the case passed and names it otherwise.
    work = Path(tempfile.mkdtemp(prefix=f"ingest-chaos-{request.node.name}-"))
    return chaos.ChaosEnv(kafka_bootstrap, pg_admin_dsn, work, long=LONG)


def _check(env: "chaos.ChaosEnv", case, results: list) -> None:
    result = case(env)
    results.append(result)
    print(chaos.render_table([result]))
    for note in result.notes:
        print(f"note: {note}")
    if result.ok:
        shutil.rmtree(env.work_dir, ignore_errors=True)
    assert result.ok, f"{result.explain()}\nconfigs and ingest logs kept in {env.work_dir}"


def test_sigkill_random_flush_dlq(chaos_env, chaos_results):
    """SIGKILL at random points, during a large flush and during a DLQ write; restart each time."""
    _check(chaos_env, chaos.case_sigkill, chaos_results)


def test_sigkill_during_rebalance(chaos_env, chaos_results):
    """Two processes: SIGKILL one right after the other logged "partitions revoked"."""
    _check(chaos_env, chaos.case_sigkill_rebalance, chaos_results)


def test_sigterm_during_large_flush(chaos_env, chaos_results):
    """SIGTERM while a large batch is written: exit 0, exactly the written records committed."""
    _check(chaos_env, chaos.case_sigterm_flush, chaos_results)


def test_sigterm_twice_aborts(chaos_env, chaos_results):
    """A second SIGTERM aborts (exit 130) without committing anything unwritten."""
    _check(chaos_env, chaos.case_sigterm_twice, chaos_results)


def test_postgres_connections_killed(chaos_env, chaos_results):
    """pg_terminate_backend on every ingest connection, repeatedly."""
    _check(chaos_env, chaos.case_pg_connections_killed, chaos_results)


def test_postgres_slow(chaos_env, chaos_results):
    """The sink table locked for longer than statement_timeout_ms."""
    _check(chaos_env, chaos.case_pg_slow, chaos_results)


def test_postgres_out_of_connections(chaos_env, chaos_results):
    """The database refuses new connections for a while."""
    _check(chaos_env, chaos.case_pg_out_of_connections, chaos_results)


def test_rebalance_storm(chaos_env, chaos_results):
    """A second consumer joins and leaves the group again and again."""
    _check(chaos_env, chaos.case_rebalance_storm, chaos_results)


def test_dlq_backend_blocked(chaos_env, chaos_results):
    """The DLQ table locked, then renamed away and back, while poison records arrive."""
    _check(chaos_env, chaos.case_dlq_blocked, chaos_results)


def test_broker_down_and_back_empty(chaos_env, chaos_results):
    """The case's own broker stops and returns empty (memory storage): no crash, no nonsense commits."""
    _check(chaos_env, chaos.case_broker_down, chaos_results)


def test_postgres_restarted(chaos_env, chaos_results):
    """The case's own throwaway PostgreSQL cluster restarted (fast, then immediate) while ingest writes."""
    _check(chaos_env, chaos.case_pg_restart, chaos_results)


def test_postgres_read_only_sessions(chaos_env, chaos_results):
    """A failover: ingest's sessions read-only (25006), then writable again for new sessions only."""
    _check(chaos_env, chaos.case_pg_read_only, chaos_results)


def test_member_frozen_past_the_session_timeout(chaos_env, chaos_results):
    """SIGSTOP one of two members past the session timeout (randomly or mid-flush), then SIGCONT."""
    _check(chaos_env, chaos.case_sigstop, chaos_results)


# --------------------------------------------------------------------------- product bugs found by the runner


def test_check_violation_among_good_records_of_its_key(chaos_env, chaos_results):
    """A CHECK-violating record as the latest of its key in one batch: the key's earlier good record
    lands and the poison one reaches the DLQ (a bug this runner found, now fixed)."""
    _check(chaos_env, chaos.case_poison_same_key, chaos_results)


def test_on_conflict_nothing_keeps_the_first_record(chaos_env):
    """``on_conflict: nothing`` is "first record wins" (README), also when a key's records share a batch.

    A bug this runner found (now fixed): ``BatchWriter.plan`` collapsed a batch by key to the
    *latest* record whatever ``on_conflict`` said, so three records of a new key in one batch
    stored the third; spread over three batches they stored the first.
    """
    with chaos.Scenario(chaos_env, "first-wins", keys=10) as scn:
        scn.produce(0, make=lambda st: st.pattern(["A", "B"], "ggg"))  # one produce call: one batch
        cfg = scn.config(name="nothing.yaml", sink={"on_conflict": "nothing", "version_column": None})
        scn.final_run(config=cfg)
        stored = dict(scn.sql_admin("SELECT k, seq FROM sink"))
        assert not scn.result.problems, scn.result.problems
        assert stored == {"A": 1, "B": 1}, (f"on_conflict nothing stored {stored}; the first records are seq 1 "
                                            f"(logs in {chaos_env.work_dir})")
    shutil.rmtree(chaos_env.work_dir, ignore_errors=True)
