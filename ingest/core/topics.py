"""Which topics a pipeline reads: literal names and patterns, less the excluded ones.

librdkafka's convention: a ``topics`` entry that begins with ``^`` is a regular expression (here
Python's :mod:`re` syntax), matched from the start of a topic name and not anchored at its end
unless it ends with ``$``; any other entry is one topic's exact name. A pattern picks up topics that
appear while the pipeline runs (the source lists the broker's topics every ``topic_refresh_s``).

``exclude_topics`` are patterns too (matched the same way, ``^`` optional), applied to the topics a
pattern found, never to a name the config lists itself. The defaults leave out what a pattern over
a Debezium-captured database would otherwise pick up besides the tables: the broker's and
Debezium's internal topics (``__consumer_offsets``, ``__debezium-heartbeat.<prefix>``,
``__transaction_state``) and the transaction metadata topic ``<prefix>.transaction`` (two dotted
parts; a table's topic has three: ``<prefix>.<schema>.<table>``). Debezium's schema-change topic is
named ``<prefix>`` alone, which a pattern ``^<prefix>\\.`` does not match.

Pure: no client, no I/O. The source asks :meth:`TopicSelector.select` with the names the broker
lists.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

#: ``exclude_topics`` when the config says nothing (see the module docstring)
DEFAULT_EXCLUDE_TOPICS: tuple[str, ...] = (r"^__", r"^[^.]+\.transaction$")


def is_pattern(entry: str) -> bool:
    """A ``topics`` entry that is a regular expression (begins with ``^``)."""
    return entry.startswith("^")


class TopicSelector:
    """The topics of one pipeline: its literal names, and the listed topics its patterns match.

    ``topics`` and ``exclude`` as in the config; a pattern that does not compile raises
    :class:`re.error` (the config validates them first, naming the field).
    """

    def __init__(self, topics: Sequence[str], exclude: Sequence[str] = DEFAULT_EXCLUDE_TOPICS) -> None:
        self.literals: tuple[str, ...] = tuple(dict.fromkeys(t for t in topics if not is_pattern(t)))
        self.patterns: tuple[re.Pattern[str], ...] = tuple(re.compile(t) for t in topics if is_pattern(t))
        self.exclude: tuple[re.Pattern[str], ...] = tuple(re.compile(e) for e in exclude)

    @property
    def has_patterns(self) -> bool:
        return bool(self.patterns)

    def matches(self, topic: str) -> bool:
        """True for a literal name, or a topic some pattern matches and no exclusion does."""
        if topic in self.literals:
            return True
        return (any(p.match(topic) for p in self.patterns)
                and not any(e.match(topic) for e in self.exclude))

    def select(self, listed: Iterable[str]) -> list[str]:
        """The topics to subscribe to, sorted: every literal name (listed or not: a missing topic is
        the broker's to report) and every ``listed`` topic a pattern matches and no exclusion does."""
        found = {t for t in listed if self.patterns and self.matches(t)}
        return sorted(found.union(self.literals))
