"""Reading a running ``ingest run``'s ``/metrics`` endpoint (Prometheus text format)."""

from __future__ import annotations

import urllib.error
import urllib.request


def get(port: int, path: str, timeout_s: float = 3.0) -> tuple[int, bytes]:
    """``(status, body)`` of ``GET http://127.0.0.1:port/path``; connection errors raise OSError."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of every sample of ``name`` whose labels include ``labels``; None when there is none."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if not all(w in line for w in want):
                continue
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def samples(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name``: ``{label text: value}`` (label text as written, '' without labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels = line[len(name) + 1:line.index("}")]
            out[labels] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + " "):
            out[""] = float(line.rsplit(" ", 1)[1])
    return out


def scrape(port: int) -> str | None:
    """The ``/metrics`` text, or None while the endpoint does not answer."""
    try:
        status, body = get(port, "/metrics")
    except OSError:
        return None
    return body.decode() if status == 200 else None
