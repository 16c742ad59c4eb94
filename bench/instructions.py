"""Instructions per record of the pipeline thread's batch work, counted by callgrind: a measure that
does not move with the machine's load, to compare checkouts where timings cannot.

    .venv/bin/python bench/instructions.py [--records 30000] [--checkouts /tmp/base .]

For each checkout (a directory holding an ``ingest`` package; default: this one), runs a worker
under ``valgrind --tool=callgrind`` twice -- once doing the work on ``--records`` records of
``bench/pg_pipeline.py``'s stream, once only making the stream -- and prints the difference per
record. The work is what the pipeline thread does per record without Kafka, the way it does it:
a ``Record`` per message (as ``KafkaSource.poll`` builds them: C maps over the message's fields),
an unmapped ``Item`` each (as the columnar tier's accept loop does), and ``BatchWriter.prepare``
of every 5000 (done offsets, size, timestamps; the columnar tier's plan: one msgspec decode, the
Arrow columns and checks, the collapse; the CSV the lane will COPY). It leaves out ``consume()``
itself, the accept loop's tracking and batching, and the lane. ``bench/hot_path_profile.py``
measures all of it in seconds on a live run.

Both runs of a checkout start the interpreter, import everything and prepare one warm-up batch, so
the difference is the work alone. ``PYTHONHASHSEED=0`` and ``OPENBLAS_NUM_THREADS=1`` (numpy's
BLAS threads, which pyarrow's import starts, spin for a while) keep the counts repeatable: the
same checkout twice differs by well under 1 %. Needs valgrind (on every machine here).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
BATCH = 5000


def worker(n: int, work: bool, checkout: Path) -> None:
    """Make ``n`` records of the stream; with ``work``, do the pipeline thread's batch work on them.
    Exits non-zero unless ``ingest`` is imported from ``checkout``."""
    import itertools
    import operator
    import threading

    sys.path.insert(0, str(BENCH))
    import ingest

    if not Path(ingest.__file__).resolve().is_relative_to(checkout):
        raise SystemExit(f"ingest was imported from {ingest.__file__}, not from {checkout}")
    from common import event
    from pg_pipeline import COLUMNS

    from ingest.config import RetrySettings
    from ingest.core.mapping import Mapper
    from ingest.runner.columnar import ColumnarTier
    from ingest.sinks.postgres.settings import PostgresSinkSettings
    from ingest.sinks.postgres.sink import PostgresSink
    from ingest.tuning import tune_for_throughput
    from ingest.types import Item, Record
    try:
        from ingest.runner.writer import BatchWriter
    except ModuleNotFoundError:  # a checkout from before the writer moved to ingest/runner/
        from ingest.writer import BatchWriter  # type: ignore[no-redef]

    cfg = PostgresSinkSettings(dsn="postgresql://u@h/d", table="t", conflict_key=["event_id"], columns=COLUMNS)
    rule = cfg.collapse_rule()
    mapper = Mapper(cfg.columns)
    plan = mapper.columnar_plan(rule.key_index)
    sink = PostgresSink(cfg, pool_size=1)  # encodes only: never connects
    sink.use_columnar(plan.columns)
    tier = ColumnarTier("bench", plan, sink.encode_columns, lambda *a, **k: None, mapper.map)
    writer = BatchWriter(pipeline="bench", write=lambda rows, **_: None, dlq=None,  # type: ignore[arg-type]
                         retry=RetrySettings(), collapse_rule=rule, abort=threading.Event(), columnar=tier)
    keys = max(1, 200_000 // 3)  # the pipeline bench's key space
    # each batch's positions in runs of one partition (partition = position % 6), as consume() returns them
    order = [sorted(range(start, min(n, start + BATCH)), key=lambda i: i % 6) for start in range(0, n, BATCH)]
    values = [event(i, (i * 7919) % keys) for i in range(n)]
    key_bytes = [str((i * 7919) % keys).encode() for i in range(n)]
    tune_for_throughput()  # as `ingest run` does
    warm = [Item(Record("topic", 0, i, key_bytes[0], values[0], 1), None, None, 1, 150) for i in range(10)]
    writer.prepare(warm)
    if not work:
        return
    for positions in order:
        records = list(map(Record, itertools.repeat("topic"), map(operator.mod, positions, itertools.repeat(6)),
                           positions, map(key_bytes.__getitem__, positions), map(values.__getitem__, positions),
                           itertools.repeat(1_700_000_000_000)))
        items = list(map(Item, records, itertools.repeat(None), itertools.repeat(None), itertools.repeat(1),
                         itertools.repeat(150)))
        if writer.prepare(items).columnar is None:
            raise SystemExit("the columnar tier declined a batch of the bench stream")


def count(checkout: Path, n: int, work: bool) -> int:
    """Instructions callgrind counted in one worker run with ``checkout``'s ``ingest``."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"}
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--worker", str(n), "--checkouts", str(checkout)] + ([] if work else ["--make-only"])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=checkout)
    m = re.search(r"Collected : (\d+)", res.stderr)
    if res.returncode != 0 or m is None:
        raise SystemExit(f"callgrind run failed ({checkout}):\n{res.stderr[-2000:]}")
    return int(m[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=30_000)
    ap.add_argument("--checkouts", type=Path, nargs="+", default=[BENCH.parent])
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--make-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    checkouts = [c.resolve() for c in args.checkouts]
    if args.worker is not None:
        worker(args.worker, not args.make_only, checkouts[0])
        return
    n = args.records
    per_record = []
    for checkout in checkouts:
        made, worked = count(checkout, n, work=False), count(checkout, n, work=True)
        per_record.append((worked - made) / n)
        print(f"{str(checkout):40s} {per_record[-1]:10,.0f} instructions per record "
              f"(callgrind, {n} records: {worked:,} less {made:,} making them)", flush=True)
    if len(per_record) > 1:
        for checkout, value in zip(checkouts[1:], per_record[1:], strict=True):
            print(f"{checkout} / {checkouts[0]}: x{value / per_record[0]:.3f}")


if __name__ == "__main__":
    main()
