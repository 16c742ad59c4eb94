"""CPU per evaluation of the two CEL bindings, and of ingest's transforms per record.

    .venv/bin/python bench/cel_bindings.py [--evals 50000] [--rounds 3]

Measures, in one process and thread (``time.process_time``, best of ``--rounds``):

  binding    each importable binding on the same expressions and variables, a fresh context per
             evaluation: ``common-expression-language`` (module ``cel``, Rust; ``compile(text)
             .execute(dict)``) and ``cel-expr-python`` (module ``cel_expr_python``, Google's C++
             runtime; ``env.compile(text).eval(data=dict)``). ingest uses the faster
             (ingest/core/transforms/cel.py). The other is not a dependency: install it beside
             (``pip install common-expression-language``) to compare; a binding that is missing is
             reported as such.
  transforms ingest's Transformer.apply on a decoded record for the pipeline of the issue's
             benchmark: one filter and three computed columns (one activation per record, shared
             by its expressions) -- the transforms' own CPU per record.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXPRESSIONS = ["value.tenant != 'test'", "int(value.amount * 100.0)", "value.sku + '-' + string(value.qty)"]
VALUE = {"id": 17, "tenant": "acme", "amount": 12.5, "sku": "A-1", "qty": 3, "ts": "2026-12-05T10:00:00Z"}
VARIABLES = {"value": VALUE, "topic": "orders", "partition": 0, "offset": 42, "timestamp": 1764928800000,
             "key": b"17", "headers": {}}


def best_us(fn: Callable[[], Any], n: int, rounds: int) -> float:
    for _ in range(min(n, 1000)):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        times.append(time.process_time() - t0)
    return min(times) / n * 1e6


def bindings() -> dict[str, Callable[[str], Callable[[], Any]] | str]:
    out: dict[str, Callable[[str], Callable[[], Any]] | str] = {}
    try:
        import cel  # common-expression-language

        out["common-expression-language"] = lambda text: (lambda p: lambda: p.execute(VARIABLES))(cel.compile(text))
    except ImportError as exc:
        out["common-expression-language"] = f"not installed ({exc})"
    try:
        from cel_expr_python import cel as cxp

        env = cxp.NewEnv(variables={k: cxp.Type.DYN for k in VARIABLES})
        out["cel-expr-python"] = lambda text: (lambda p: lambda: p.eval(data=VARIABLES).plain_value())(
            env.compile(text))
    except ImportError as exc:
        out["cel-expr-python"] = f"not installed ({exc})"
    return out


def transforms_us(n: int, rounds: int) -> float:
    import orjson

    from ingest.config.transforms import TransformStep
    from ingest.core.transforms import compile_transforms
    from ingest.types import Record

    steps = [TransformStep.model_validate(s) for s in [
        {"filter": "value.tenant != 'test'"},
        {"set": {"amount_cents": "int(value.amount * 100.0)", "label": "value.sku + '-' + string(value.qty)",
                 "source": "'shop'"}},
    ]]
    t = compile_transforms(steps, "bench", plain_values=True)  # format: json, as mapper_for passes it
    assert t is not None
    record = Record("orders", 0, 42, b"17", orjson.dumps(VALUE), 1764928800000)
    return best_us(lambda: t.apply(record, VALUE), n, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evals", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; {args.evals} evaluations per measure, best of {args.rounds} (CPU)")
    for name, make in bindings().items():
        if isinstance(make, str):
            print(f"{name:28s} {make}")
            continue
        for text in EXPRESSIONS:
            print(f"{name:28s} {text!r:45s} {best_us(make(text), args.evals, args.rounds):6.2f} us/eval")
    print(f"{'ingest transforms':28s} {'1 filter + 3 set columns, per record':45s} "
          f"{transforms_us(args.evals, args.rounds):6.2f} us/record")


if __name__ == "__main__":
    main()
