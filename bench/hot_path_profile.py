"""Where ingest's own CPU per record goes: ``ingest run`` of the pipeline bench's stream, by thread and by stage.

    .venv/bin/python bench/hot_path_profile.py [--records 200000] [--rounds 3] [--rows] [--no-py-spy]

Starts the embedded broker and PostgreSQL (or uses ``$INGEST_PG_DSN``), produces
``bench/pg_pipeline.py``'s stream (JSON order records, 6 partitions, one key in three updated
twice) and runs ``ingest run`` on it in that script's default configuration (1 process, 1 lane:
the columnar tier; ``--rows``: ``columnar: false``, the row path) through ``bench/thread_names.py``,
which names each Python thread in the OS after its ``threading`` name. Then:

1. **By thread** (``--rounds`` runs and one on an empty topic): every thread's CPU time is read
   from ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds) every 20 ms until the process ends, and
   summed per group (:data:`GROUPS`: the pipeline thread, its lane, the DLQ pool, librdkafka's
   threads, the rest). Each group's µs per record is its CPU less the idle run's, the median of the
   rounds; the process total is user + sys of the whole process (rusage) less the idle run's --
   ingest's own CPU as ``bench/pg_pipeline.py`` reports it, the figure issue #19 sets at 4 µs.
2. **The floor beside it**: a bare confluent-kafka ``consume()`` loop over the same records with
   ingest's consumer settings (process CPU, librdkafka's threads included), in every round.
3. **By stage** (one more run, under ``py-spy record --nonblocking``, raw stacks): each sample of
   the pipeline and lane threads is given to the innermost stage of :data:`STAGES` on its stack,
   and the stage's share of its thread's samples times that thread's µs per record in the busy
   window (from part 1) is its cost. py-spy counts only samples where a thread was running, so
   shares are of CPU; they span the whole run (its raw stacks carry no time), but outside the busy
   window the pipeline thread and the lane mostly wait, which py-spy does not sample.

Exits non-zero when a run's table does not hold each key's last record.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import inspect
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BusySampler, children_cpu_s, consume_all, create_topic, produce  # noqa: E402
from components import bare_consume  # noqa: E402
from pg_pipeline import WIDTH, check_table, e2e_config, make_table, sink_settings  # noqa: E402

from ingest.config import KafkaSettings  # noqa: E402
from ingest.core.mapping import Mapper  # noqa: E402
from ingest.embedded import start_all  # noqa: E402
from ingest.sources.kafka import KafkaSource  # noqa: E402

SHIM = Path(__file__).resolve().parent / "thread_names.py"
#: py-spy, from PATH or beside this interpreter (a virtualenv's bin/ need not be on PATH)
PY_SPY = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))

#: Thread groups by OS thread name (``bench/thread_names.py`` names the Python threads), first match.
GROUPS: list[tuple[str, re.Pattern[str]]] = [
    ("pipeline thread", re.compile(r"^pipeline-")),
    ("lane", re.compile(r"-lane-\d+$")),
    ("DLQ pool", re.compile(r"-dlq|^dlq-")),  # the writer's DLQ executor, the DLQ's connection pool
    ("librdkafka", re.compile(r"^rdk:")),
    ("main and others", re.compile(r"")),
]


def _line_of(func: object, text: str) -> int:
    """The source line of ``func`` that holds ``text`` (how py-spy names a frame waiting in that call)."""
    lines, first = inspect.getsourcelines(func)  # type: ignore[arg-type]
    return first + next(i for i, line in enumerate(lines) if text in line)


#: The line of ``KafkaSource.poll`` that calls librdkafka's ``consume()``: samples there are in C,
#: inside confluent-kafka (the hand-over of fetched messages and a Message object each).
CONSUME_LINE = _line_of(KafkaSource.poll, "self._consumer.consume(")

#: Stages of the hot path: (name, file suffix, function pattern, line or None). A sample belongs to
#: the innermost frame of ingest's that matches; frames in libraries count for the ingest frame
#: that called them. Order matters only between rules of one frame (the first match wins).
STAGES: list[tuple[str, str, str, int | None]] = [
    ("consume() in librdkafka / Message objects", "ingest/sources/kafka.py", r"KafkaSource\.poll$", CONSUME_LINE),
    ("Record per message", "ingest/sources/kafka.py", r".", None),
    ("accept: offsets tracked, Item per record, sizes", "ingest/runner/accept.py", r".", None),
    ("batcher (ring buffer, flush rules)", "ingest/core/batcher.py", r".", None),
    ("batcher (ring buffer, flush rules)", "ingest/runner/batching.py", r".", None),
    ("columnar: decode (msgspec, one call per batch)", "ingest/core/mapping/columnar.py", r"_decode$|_framed$", None),
    ("columnar: Arrow columns, checks, collapse", "ingest/core/mapping/columnar.py", r".", None),
    ("columnar: CSV encoding (Arrow)", "ingest/sinks/postgres/columnar.py", r".", None),
    ("row path: map (compiled mapper)", "ingest/core/mapping/", r".", None),
    ("write: COPY + upsert (psycopg, client side)", "ingest/sinks/postgres/", r".", None),
    ("write: COPY + upsert (psycopg, client side)", "ingest/drivers/postgres.py", r".", None),
    ("prepare and columnar glue (tier, token, poison)", "ingest/runner/columnar.py", r".", None),
    ("prepare and columnar glue (tier, token, poison)", "ingest/runner/writer.py", r".", None),
    ("prepare and columnar glue (tier, token, poison)", "ingest/core/collapse.py", r".", None),
    ("completions, offsets, commits", "ingest/core/offsets.py", r".", None),
    ("completions, offsets, commits", "ingest/runner/commits.py", r".", None),
    ("completions, offsets, commits", "ingest/runner/drain.py", r".", None),
]
OTHER = "the loop itself, metrics, flow control, other"

#: py-spy's sampling rate (prime: no aliasing with the loop's 20 ms and 200 ms periods)
SPY_HZ = 997
#: ... and the share of a thread's samples a line needs to be listed under its stage
DETAIL_SHARE = 0.02

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")


def stage_of(frames: list[str]) -> tuple[str, str] | None:
    """The stage of a stack (frames outermost first, py-spy's raw format) and its innermost frame of
    ingest's (``function (file:line)``), or None: no frame of ingest's."""
    innermost = None
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        if m is None or "/ingest/" not in "/" + m["file"]:
            continue
        path = m["file"][m["file"].rfind("ingest/"):]
        innermost = innermost or f"{m['func']} ({path}:{m['line']})"
        for name, suffix, func, line in STAGES:
            if path.startswith(suffix) and re.search(func, m["func"]) and (line is None or int(m["line"]) == line):
                return name, innermost
    return (OTHER, innermost) if innermost else None


def _group(name: str) -> str:
    return next(group for group, pattern in GROUPS if pattern.search(name))


class ThreadCpu:
    """Samples every thread of process ``pid`` every ``interval_s`` until it ends: tid → (name, CPU ns),
    the last values seen, and every sample on the monotonic clock (for :meth:`in_window`)."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.threads: dict[int, tuple[str, int]] = {}
        #: (monotonic seconds, tid → CPU ns) of every sample
        self._samples: list[tuple[float, dict[int, int]]] = []
        self._pid = pid
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="thread-cpu", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        task = Path(f"/proc/{self._pid}/task")
        while True:
            try:
                tids = os.listdir(task)
            except OSError:
                return  # the process is gone
            at, sample = time.monotonic(), {}
            for tid in tids:
                try:
                    name = (task / tid / "comm").read_text().strip()
                    ns = int((task / tid / "schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue  # the thread ended between the listing and the read
                self.threads[int(tid)] = (name, ns)
                sample[int(tid)] = ns
            self._samples.append((at, sample))
            time.sleep(self._interval_s)

    def join(self) -> dict[str, float]:
        """CPU-seconds per group (:data:`GROUPS`), once the process has ended."""
        self._thread.join()
        out: dict[str, float] = collections.defaultdict(float)
        for name, ns in self.threads.values():
            out[_group(name)] += ns / 1e9
        return dict(out)

    def names(self) -> dict[int, str]:
        return {tid: name for tid, (name, _) in self.threads.items()}

    def in_window(self, start: float, end: float) -> dict[str, float]:
        """CPU-seconds per group between monotonic times ``start`` and ``end``: each thread's CPU
        interpolated between the samples around each time (0 before its first sample, its last value
        after its last: a thread that started or ended inside the window counts what it used there)."""
        series: dict[int, tuple[list[float], list[int]]] = {}
        for at, sample in self._samples:
            for tid, ns in sample.items():
                times, values = series.setdefault(tid, ([], []))
                times.append(at)
                values.append(ns)
        out: dict[str, float] = collections.defaultdict(float)
        for tid, (times, values) in series.items():
            used_ns = _at(times, values, end) - _at(times, values, start)
            out[_group(self.threads[tid][0])] += used_ns / 1e9
        return dict(out)


def _at(times: list[float], values: list[int], t: float) -> float:
    """A thread's CPU ns at time ``t``, linear between the samples around it (``times`` ascending)."""
    i = bisect.bisect_left(times, t)
    if i == 0:
        return 0.0 if t < times[0] else float(values[0])
    if i == len(times):
        return float(values[-1])
    t0, t1, v0, v1 = times[i - 1], times[i], values[i - 1], values[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else float(v1)


def run_ingest(bootstrap: str, dsn: str, topic: str, table: str, columnar: bool | None,
               spy: Path | None = None) -> tuple[float, dict[str, float], dict[int, str], dict]:
    """One ``ingest run --until-idle`` of ``topic`` into a fresh ``table`` through the thread-name shim
    (under py-spy when ``spy`` is a path for its raw stacks): its process CPU-seconds (rusage), CPU per
    thread group, tid → thread name, and its run summary."""
    make_table(dsn, table, keyed=True)
    cfg = e2e_config(bootstrap, topic, dsn, table, lanes=1, columnar=columnar)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.yaml"
        path.write_text(yaml.safe_dump(cfg))
        summary = Path(tmp) / "summary.json"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", "ingest", "migrate", "-c", str(path)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        cmd = [sys.executable, str(SHIM), "run", "-c", str(path), "--until-idle", "3", "--metrics-port", "0",
               "--log-level", "warning", "--summary-json", str(summary)]
        if spy is not None:
            cmd = [PY_SPY or "py-spy", "record", "--format", "raw", "--threads", "--rate", str(SPY_HZ),
                   "--nonblocking", "-o", str(spy), "--", *cmd]
        before = children_cpu_s()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        pid = proc.pid
        if spy is not None:  # the Python process is py-spy's child
            import psutil

            deadline = time.monotonic() + 10
            while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
                time.sleep(0.005)
            pid = psutil.Process(proc.pid).children()[0].pid
        sampler = ThreadCpu(pid)
        with BusySampler() as busy:
            if proc.wait() != 0:
                raise SystemExit(f"ingest run exited {proc.returncode}")
        process_cpu_s = children_cpu_s() - before
        groups = sampler.join()
        stats = orjson.loads(summary.read_bytes())["pipelines"]["bench"]
    # the machine's busy CPU (every process) from the first record to the last batch handled
    window = stats.get("busy_window_s") or [None, None]
    stats["machine_cpu_s"] = busy.cpu_s(*window) if None not in window else None
    stats["window_groups_s"] = sampler.in_window(*window) if None not in window else {}
    return process_cpu_s, groups, sampler.names(), stats


#: A sample of a thread that was in no frame of ingest's.
OUTSIDE = "outside ingest's code (interpreter start-up, libraries' threads)"


def stage_shares(raw: Path, names: dict[int, str]) -> dict[str, dict[str, collections.Counter[str]]]:
    """Samples per thread group, per stage, per innermost frame of ingest's, from py-spy's raw stacks
    (``thread (<tid>);frame;... count``)."""
    out: dict[str, dict[str, collections.Counter[str]]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter))
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        m = re.match(r"thread \((\d+)\)", frames[0])
        if m is None:
            continue
        stage, innermost = stage_of(frames[1:]) or (OUTSIDE, "")
        out[_group(names.get(int(m[1]), ""))][stage][innermost] += int(count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", action="store_true", help="profile the row path (columnar: false)")
    ap.add_argument("--no-py-spy", action="store_true", help="skip the by-stage run under py-spy")
    args = ap.parse_args()
    n = args.records
    columnar = False if args.rows else None
    services = start_all()
    bootstrap, dsn = services.bootstrap, services.pg_dsn
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    topic = f"bench-profile-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    produce(bootstrap, topic, n)
    idle_topic = f"bench-profile-idle-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, idle_topic)
    print(f"produced {n} records to {topic}; configuration: 1 process, 1 lane, "
          f"{'rows (columnar: false)' if args.rows else 'default (the columnar tier)'}", flush=True)
    # what every run's table must hold: each key's last record, mapped by the row mapper
    mapper = Mapper(sink_settings(dsn, "x").columns)
    records, _ = consume_all(bootstrap, topic, n)
    expected = {row[0]: tuple(row[:WIDTH]) for row in (mapper.map(rec)[0] for rec in records)}

    idle_s, idle_groups, _, _ = run_ingest(bootstrap, dsn, idle_topic, "bench_profile_idle", columnar)
    totals, per_group, floors, machine, rates = [], collections.defaultdict(list), [], [], []
    in_window: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        floors.append(bare_consume(kafka, topic, n) / n * 1e6)
        table = f"bench_profile_{r}"
        cpu_s, groups, _, stats = run_ingest(bootstrap, dsn, topic, table, columnar)
        check_table(dsn, table, expected)
        if stats["records_consumed"] != n:
            raise SystemExit(f"round {r + 1}: consumed {stats['records_consumed']} of {n}")
        totals.append((cpu_s - idle_s) / n * 1e6)
        rates.append(stats["records_consumed"] / stats["busy_s"])
        machine.append(stats["machine_cpu_s"] / n * 1e6)
        for group in {*groups, *idle_groups}:
            per_group[group].append((groups.get(group, 0.0) - idle_groups.get(group, 0.0)) / n * 1e6)
        for group, _ in GROUPS:
            in_window[group].append(stats["window_groups_s"].get(group, 0.0) / n * 1e6)
        in_window["sum"].append(sum(stats["window_groups_s"].values()) / n * 1e6)
        print(f"round {r + 1}/{args.rounds}: own CPU {totals[-1]:.2f} µs/record (busy window: "
              f"{in_window['sum'][-1]:.2f}), bare consume() {floors[-1]:.2f}, {rates[-1]:,.0f} records/s, "
              f"the machine's CPU {machine[-1]:.2f} µs/record", flush=True)

    own = statistics.median(totals)
    group_us = {group: statistics.median(v) for group, v in per_group.items()}
    window_us = {group: statistics.median(v) for group, v in in_window.items()}
    print(f"\ningest's own CPU per record by thread, {n} records, medians of {args.rounds} rounds: the whole run less "
          f"an idle run ({idle_s:.2f} s of process CPU), and the busy window alone (first record to last batch "
          f"handled: no start-up, no idle wait, nothing to subtract)")
    print(f"  {'':28s} {'whole run':>10s} {'busy window':>12s}")
    for group, _ in GROUPS:
        print(f"  {group:28s} {group_us.get(group, 0.0):7.2f} µs {window_us.get(group, 0.0):9.2f} µs")
    print(f"  {'sum of the threads':28s} {sum(group_us.values()):7.2f} µs {window_us['sum']:9.2f} µs")
    print(f"  {'the process (rusage)':28s} {own:7.2f} µs   (issue #19's goal: 4 µs; the bare consume() loop "
          f"over the same records: {statistics.median(floors):.2f} µs, × {own / statistics.median(floors):.2f})")
    cores = os.cpu_count() or 1
    machine_us, rate = statistics.median(machine), statistics.median(rates)
    print(f"\nthe machine's CPU per record in the busy window (every process: broker, PostgreSQL, ingest): "
          f"{machine_us:.2f} µs, of which ingest's own {window_us['sum']:.2f} and the rest "
          f"{machine_us - window_us['sum']:.2f}; at {rate:,.0f} records/s that is {rate * machine_us / 1e6:.2f} of "
          f"{cores} cores busy (cap at this CPU per record: {cores * 1e6 / machine_us:,.0f} records/s)")
    if args.no_py_spy or PY_SPY is None:
        if not args.no_py_spy:
            print("\npy-spy is not installed (pip install py-spy): no by-stage profile")
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "spy.txt"
        table = "bench_profile_spy"
        _, _, names, stats = run_ingest(bootstrap, dsn, topic, table, columnar, spy=raw)
        check_table(dsn, table, expected)
        shares = stage_shares(raw, names)
    for group in ("pipeline thread", "lane", "main and others"):
        stages = shares.get(group)
        if not stages:
            continue
        counts = collections.Counter({stage: sum(lines.values()) for stage, lines in stages.items()})
        total = sum(counts.values())
        us = window_us.get(group, 0.0)
        print(f"\n{group} by stage (py-spy, {total} samples at {SPY_HZ} Hz; µs = share × the thread's "
              f"{us:.2f} µs of the busy window above; under each, the innermost lines of ingest's code with at "
              f"least {DETAIL_SHARE:.0%} of it)")
        for stage, count in counts.most_common():
            print(f"  {stage:58s} {count / total:6.1%} {count / total * us:6.2f} µs")
            for where, c in stages[stage].most_common():
                if c >= DETAIL_SHARE * total and where:
                    print(f"      {where:70s} {c / total:6.1%}")


if __name__ == "__main__":
    main()
