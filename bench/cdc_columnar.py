"""The columnar tier's plan of a Debezium batch against the row mapper, in-process (no broker, no database).

    .venv/bin/python bench/cdc_columnar.py [--events 5000] [--rounds 5] [--schemas]

Makes ``--events`` change events of ``bench/cdc_pipeline.py``'s stream (b) (``--schemas``: (c), the schema
part with precise decimals and MicroTimestamp) with the test harness's simulated source table, drops the
tombstones (the accept loop skips them), and times with process CPU, best of ``--rounds``, per record:
the row mapper (``ChangeMapper.map`` of every record), the unwrap both share (``change_image``), the
tier's listing of the values (``ChangePlan._documents``) and its whole plan of the batch
(``ChangePlan.build``: unwrap, listing, both column plans, the collapse).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from harness.cdc_source import SourceTable  # noqa: E402

from ingest.cdc.mapper import mapper_for  # noqa: E402
from ingest.config import PipelineSettings  # noqa: E402
from ingest.types import Record  # noqa: E402

COLUMNS = {"id": {"type": "bigint"}, "name": {"type": "text"}, "price": {"type": "numeric(12,2)"},
           "qty": {"type": "integer"}, "updated_at": {"type": "timestamptz"},
           "lsn": {"type": "bigint", "source": "@source.lsn"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schemas", action="store_true", help="stream (c): the schema part, precise decimals")
    args = parser.parse_args()
    settings = PipelineSettings.model_validate({
        "name": "bench", "topics": ["t"], "envelope": "debezium", "deletes": {"mode": "hard"},
        "sink": {"table": "items", "conflict_key": ["id"], "version_column": "lsn", "columns": COLUMNS}})
    rule = settings.collapse_rule()
    mapper = mapper_for(settings)
    plan = mapper.columnar_plan(rule.key_index, rule.version_index)
    assert plan is not None, mapper.columnar_refusal(rule.key_index, rule.version_index)
    source = SourceTable(1, keys=max(1, args.events // 3), partitions=6, delete_frac=0.2, schemas=args.schemas,
                         encoding="precise" if args.schemas else "string")
    records = [Record("t", p, i, k, v, None) for i, (k, v, p, _) in enumerate(source.events(args.events))
               if v is not None]
    n = len(records)

    def timed(label: str, work) -> None:
        best = float("inf")
        for _ in range(args.rounds):
            started = time.process_time()
            work()
            best = min(best, time.process_time() - started)
        print(f"{label:<48}{best / n * 1e6:>8.2f} us/record")

    print(f"{n} change events ({'schema part' if args.schemas else 'no schema part'}), best of {args.rounds}")
    timed("row mapper (ChangeMapper.map)", lambda: [mapper.map(r) for r in records])
    timed("unwrap both share (change_image)", lambda: [mapper.change_image(r) for r in records])
    timed("tier: values listed (ChangePlan._documents)", lambda: plan._documents(records))
    timed("tier: the batch planned (ChangePlan.build)", lambda: plan.build(records))
    built = plan.build(records)
    print(f"(the plan took {n - len(built.rejected)} of {n} records; {built.table.num_rows} rows after the collapse)")


if __name__ == "__main__":
    main()
