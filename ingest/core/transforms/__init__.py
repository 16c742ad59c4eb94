"""Transforms: a pipeline's ``transforms:`` steps applied to each decoded record before mapping.

- :mod:`.cel`: the CEL binding (``cel-expr-python``) behind three calls: compile (cached, once per
  expression text and process), evaluate, and the conversion of results to JSON-like values;
- :mod:`.timestamps`: the ``timestamp`` step's parsers (epoch units, ISO 8601, strptime);
- :mod:`.steps`: one class per step kind, each ``apply(doc, ctx) -> doc``;
- :mod:`.compile`: configured steps → a :class:`~.compile.Transformer` (``apply(record, doc)``),
  and the config check that names ``pipelines[0].transforms[2].set.amount_cents``.

Pure logic: no I/O, no clock. A step that fails on a record raises
:class:`~ingest.errors.InvalidRecord` (stage ``transform``, class ``transform_error``, the message
naming the step's index and label); a filter that drops a record raises
:class:`~ingest.errors.Filtered`. Where this runs: :mod:`ingest.cdc.mapper` wraps the row mapper
(:class:`ingest.cdc.mapper.TransformingMapper`), so the pipeline, ``replay-dlq`` and
``ingest preview`` all apply the pipeline's current transforms the same way. On the columnar tier,
steps in the subset of :mod:`.subset` are evaluated on whole batches by :mod:`.columnar`, which
hands every record it cannot vouch for to that row path.
"""

from ingest.core.transforms.compile import Transformer, check_transforms, compile_transforms

__all__ = ["Transformer", "check_transforms", "compile_transforms"]
