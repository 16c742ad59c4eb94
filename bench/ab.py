"""A/B: two checkouts of ingest, end to end on the same records, rounds interleaved, in one run.

    .venv/bin/python bench/ab.py --a /tmp/base --b . [--sink postgres|clickhouse] [--rounds 3] [--lanes 1]

Each round runs ``ingest run --until-idle`` of checkout A, then of B (the order
alternates per round), over one topic produced once, with ``PYTHONPATH`` set to
the checkout; an idle run of each (same configuration, empty topic) is taken
per round too. Prints, per checkout, the median end-to-end records/s and
ingest's own CPU per record (user + sys of its processes, less the idle run),
and the ratios B/A. Checkouts are any directories holding an ``ingest``
package, e.g. ``git worktree add /tmp/base <commit>``. The harness (tables,
services, this script) is the running checkout's; only ``ingest`` differs.

On a shared machine, slow spells of seconds hit single runs: read the medians
over interleaved rounds, and repeat the run before trusting a difference of a
few percent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import clickhouse_pipeline as chb  # noqa: E402
import pg_pipeline as pgb  # noqa: E402
from common import create_topic, produce  # noqa: E402

from ingest.embedded import start_all  # noqa: E402


def _use(checkout: Path) -> None:
    """Make the ``ingest`` subprocesses import ``checkout``'s package."""
    os.environ["PYTHONPATH"] = str(checkout)
    chb.ENV["PYTHONPATH"] = str(checkout)


def _round_pg(services, topic: str, lanes: int, n: int) -> tuple[float, float]:
    idle = pgb.idle_cpu_s(services.bootstrap, services.pg_dsn, lanes, 1)
    res = pgb.end_to_end(services.bootstrap, topic, services.pg_dsn, lanes, 1)
    assert res["consumed"] == n, f"end to end consumed {res['consumed']} of {n}"
    return res["rate"], (res["process_cpu_s"] - idle) / n * 1e6


def _round_ch(services, topic: str, lanes: int, n: int, workdir: Path, tag: int) -> tuple[float, float]:
    idle = chb.idle_cpu_s(services.bootstrap, workdir, lanes, services.pg_dsn)
    res = chb.end_to_end(services.bootstrap, topic, workdir, lanes, services.pg_dsn, n, tag)
    assert res["consumed"] == n, f"end to end consumed {res['consumed']} of {n}"
    return res["rate"], (res["process_cpu_s"] - idle) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    ap.add_argument("--b", type=Path, required=True, help="checkout B (the change)")
    ap.add_argument("--sink", choices=["postgres", "clickhouse"], default="postgres")
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=1)
    args = ap.parse_args()
    checkouts = {"A": args.a.resolve(), "B": args.b.resolve()}
    for label, path in checkouts.items():
        if not (path / "ingest" / "__init__.py").exists():
            ap.error(f"--{label.lower()} {path}: no ingest package there")

    services = start_all()
    results: dict[str, list[tuple[float, float]]] = {"A": [], "B": []}
    try:
        topic = f"bench-ab-{uuid.uuid4().hex[:8]}"
        create_topic(services.bootstrap, topic)
        produce(services.bootstrap, topic, args.records)
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                order = ["A", "B"] if rnd % 2 == 0 else ["B", "A"]
                for label in order:
                    _use(checkouts[label])
                    if args.sink == "postgres":
                        got = _round_pg(services, topic, args.lanes, args.records)
                    else:
                        got = _round_ch(services, topic, args.lanes, args.records, Path(tmp), rnd * 2 + order.index(label))
                    results[label].append(got)
                    print(f"round {rnd + 1}/{args.rounds} {label}: {got[0]:,.0f} records/s, "
                          f"ingest's own CPU {got[1]:.2f} us/record", flush=True)
    finally:
        services.close()

    print(f"\n{args.sink}, {args.records} records, lanes={args.lanes}, {args.rounds} interleaved rounds (medians)")
    med = {k: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
    for label, path in checkouts.items():
        print(f"  {label} {str(path):<40} {med[label][0]:>10,.0f} records/s   {med[label][1]:6.2f} us/record")
    print(f"  B/A: records/s x{med['B'][0] / med['A'][0]:.3f}   own CPU per record x{med['B'][1] / med['A'][1]:.3f}")


if __name__ == "__main__":
    main()
