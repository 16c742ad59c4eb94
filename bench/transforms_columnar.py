"""The columnar plan alone, with and without transforms (issue #37 item 8): the transforms' own CPU per record.

    .venv/bin/python bench/transforms_columnar.py [--records 5000] [--repeat 10] [--rounds 7]

No services. Builds ``bench/transforms_pipeline.py``'s two pipelines -- plain (five columns) and
transforms (one filter and three computed columns) -- as the run would (``mapper_for``, the
columnar plan), and times :meth:`ColumnarPlan.build <ingest.core.mapping.columnar.ColumnarPlan.build>`
on one batch of the benchmark's records (bench/common.py's ``event``): decode, transforms, Arrow
columns, checks, collapse. Prints process CPU per record (``time.process_time``; median and best of
``--rounds``, each ``--repeat`` builds), interleaved, and the difference: what the transforms add
to the plan. Checks first that both plans take every record (none handed to the row path) and that
the transforms plan computes the row path's values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import event  # noqa: E402
from pg_pipeline import COLUMNS  # noqa: E402
from transforms_pipeline import T_COLUMNS, TRANSFORMS  # noqa: E402

from ingest.cdc.mapper import mapper_for  # noqa: E402
from ingest.config import PipelineSettings  # noqa: E402
from ingest.types import Record  # noqa: E402


def plan_of(columns: dict, transforms: list | None) -> tuple:
    p = PipelineSettings.model_validate({
        "name": "b", "topics": ["t"], "lanes": 1, **({"transforms": transforms} if transforms else {}),
        "sink": {"kind": "postgres", "dsn": "postgresql://u@h/d", "table": "t", "conflict_key": ["event_id"],
                 "columns": columns}})
    mapper = mapper_for(p)
    plan = mapper.columnar_plan(p.collapse_rule().key_index)
    assert plan is not None, mapper.columnar_refusal(p.collapse_rule().key_index)
    return plan, mapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    n = args.records
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())  # as a run with the columnar tier does (ingest.runner.columnar)
    records = [Record("t", i % 6, i, str(i).encode(), event(i, i), 1_700_000_000_000 + i) for i in range(n)]
    plans = {"plain": plan_of(COLUMNS, None), "transforms": plan_of(T_COLUMNS, TRANSFORMS)}
    for name, (plan, mapper) in plans.items():
        built = plan.build(records)
        assert built is not None and not built.rejected, (name, None if built is None else built.rejected[:5])
        if name == "transforms":
            rows = built.table.to_pylist()
            names = list(T_COLUMNS)
            for i in (0, n // 2, n - 1):  # the integer, text and computed columns (the others the database converts)
                want = dict(zip(names, mapper.map(records[i])[0], strict=False))
                for name in ("event_id", "user_id", "kind", "amount_cents", "label", "bucket"):
                    assert rows[i][name] == want[name], (name, rows[i], want)
    cpu: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.rounds):
        for name, (plan, _) in plans.items():
            started = time.process_time()
            for _ in range(args.repeat):
                plan.build(records)
            cpu[name].append((time.process_time() - started) / (args.repeat * n) * 1e6)
    print(f"ColumnarPlan.build, batches of {n} records, {args.rounds} rounds of {args.repeat}: process CPU per record")
    for name in plans:
        print(f"{name:12s} median {statistics.median(cpu[name]):.3f} us, best {min(cpu[name]):.3f} us")
    print(f"transforms - plain: median {statistics.median(cpu['transforms']) - statistics.median(cpu['plain']):.3f} us, "
          f"best {min(cpu['transforms']) - min(cpu['plain']):.3f} us per record")


if __name__ == "__main__":
    main()
