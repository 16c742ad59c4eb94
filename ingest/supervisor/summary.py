"""The children's ``--summary-json`` documents merged into the parent's one."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)


def _add(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Sum numbers, merge nested dicts, concatenate lists; other values: the last one.

    ``busy_window_s`` (first record, last batch on the system-wide monotonic clock)
    merges into the earliest start and the latest end, and ``busy_s`` becomes
    that window's length (all processes together), or the longest ``busy_s``
    when a child gave no window.
    """
    for k, v in other.items():
        cur = into.get(k)
        if k == "busy_window_s":
            into[k] = _merge_window(cur, v)
            if into[k] is not None and None not in into[k]:
                into["busy_s"] = round(into[k][1] - into[k][0], 3)
            continue
        if k == "busy_s" and into.get("busy_window_s") is not None:
            continue
        if isinstance(v, list):
            into[k] = [*(cur if isinstance(cur, list) else []), *v]
        elif isinstance(v, bool) or not isinstance(v, (int, float, dict)):
            into[k] = v
        elif isinstance(v, dict):
            if not isinstance(cur, dict):
                cur = into[k] = {}
            _add(cur, v)
        elif k == "busy_s":
            into[k] = max(cur or 0, v)
        else:
            into[k] = round((cur or 0) + v, 3) if isinstance(v, float) or isinstance(cur, float) else (cur or 0) + v


def _merge_window(a: Sequence[float | None] | None, b: Sequence[float | None] | None) -> list[float | None] | None:
    """The union span of two (start, end) windows; a missing side or end is ignored."""
    windows = [w for w in (a, b) if w is not None and None not in w]
    if not windows:
        return list(a) if a is not None else (list(b) if b is not None else None)
    return [min(w[0] for w in windows), max(w[1] for w in windows)]  # type: ignore[type-var]


def merge_summaries(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One ``--summary-json`` document from the children's: counters summed, errors prefixed by index."""
    pipelines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    rss = 0
    for s in summaries:
        for name, stats in (s.get("pipelines") or {}).items():
            _add(pipelines.setdefault(name, {}), stats)
        rss += int(s.get("peak_rss_bytes") or 0)
        idx = s.get("_index")
        for name, msg in (s.get("errors") or {}).items():
            text = f"process {idx}: {msg}" if idx is not None else str(msg)
            errors[name] = f"{errors[name]}; {text}" if name in errors else text
    return {"pipelines": pipelines, "errors": errors, "peak_rss_bytes": rss}


def read_summary(path: Path) -> dict[str, Any] | None:
    """A child's summary document, or None when it wrote none (a killed child) or it is unreadable."""
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def write_summary(path: Path, processes: Sequence[Mapping[str, Any]], per_child: Sequence[Sequence[Mapping[str, Any]]],
                  elapsed_s: float, code: int) -> None:
    """Write the parent's document: merged counters plus a ``processes`` list.

    ``processes[i]`` holds child i's ``index``, ``pid``, ``exit_code`` and
    ``restarts``; ``per_child[i]`` its summaries, one per incarnation.
    """
    tagged = [{**s, "_index": p["index"]} for p, sums in zip(processes, per_child, strict=True) for s in sums]
    merged = merge_summaries(tagged)
    doc = {
        "elapsed_s": round(elapsed_s, 3),
        # the sum of the children's peaks (an upper bound of the footprint at any moment)
        "peak_rss_bytes": merged["peak_rss_bytes"],
        "pipelines": merged["pipelines"],
        "errors": merged["errors"],
        "exit_code": code,
        "processes": [{**p, "summary": sums[-1] if sums else None} for p, sums in zip(processes, per_child, strict=True)],
    }
    try:
        Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    except OSError as exc:
        log.error("cannot write the summary", extra={"path": str(path), "error": str(exc)})
