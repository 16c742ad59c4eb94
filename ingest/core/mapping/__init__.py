"""Record → row mapping: :class:`~ingest.core.mapping.mapper.Mapper` (see its module for the design).

- :mod:`.mapper`: the plan per column and the generic loop, which alone decides errors;
- :mod:`.fastmap`: the compiled fast path (must give exactly what the loop gives);
- :mod:`.getters`: paths into the decoded document and record metadata;
- :mod:`.coerce_pg`, :mod:`.coerce_ch`: values for each sink dialect's column types;
- :mod:`.common`: what they share.
"""

from ingest.core.mapping.mapper import Mapper

__all__ = ["Mapper"]
