"""``ingest run --processes P``: P worker processes in one consumer group.

The parent starts P children, ``python -m ingest run <the same arguments>``
(minus ``--processes``), and supervises them. Each child is an ordinary,
complete ``ingest run``: it joins the configured consumer groups, and Kafka's
group protocol spreads the partitions over the children exactly as it would
over P containers. The parent consumes nothing, opens no broker or database
connection and serves no port; it only starts, signals and reaps.

Children are started with :mod:`subprocess` (fork + exec of a fresh
interpreter), never ``multiprocessing`` fork: librdkafka and the lane threads
do not survive a fork.

What each child gets
--------------------
- env ``INGEST_PROCESS_INDEX`` = 0..P-1 (stable across restarts; every JSON log
  line of the child carries it as ``"process"``), ``INGEST_PROCESS_COUNT`` = P,
  and ``INGEST_PROCESSES=1`` (a child never supervises);
- its own metrics port: ``--metrics-port`` base + index when the base is
  non-zero (default 9464 → 9464, 9465, ...), so every child keeps its own
  ``/metrics``, ``/healthz`` and ``/readyz`` (scrape P ports); 0 stays 0 (off)
  for all. A port already taken only costs that child its endpoint (logged);
- ``--summary-json PATH.<index>`` when the parent has ``--summary-json PATH``;
  the parent then writes PATH itself: the pipelines' counters summed over all
  children (and all incarnations of a restarted child) plus a ``processes``
  list with each child's exit code, restarts and own summary;
- stdin from /dev/null; stdout/stderr inherited (one stream, lines tagged by
  ``"process"``);
- its own process group, so a terminal's Ctrl-C reaches only the parent,
  which forwards it once (otherwise every child would see the signal twice:
  once from the terminal, once forwarded, and abort);
- ``PR_SET_PDEATHSIG = SIGTERM`` (Linux): if the parent is SIGKILLed, every
  child still gets a SIGTERM and stops cleanly with its final commit.

Signals
-------
SIGTERM / SIGINT to the parent is forwarded at once to every running child
(each stops fetching, flushes, commits, exits 0 — see ``ingest.cli.run``); a
pending restart is cancelled. A second signal is forwarded again: the children
abort (exit 130). If children are still alive ``kill_after_s`` after the
second signal, they are SIGKILLed (nothing unwritten is committed either way).
User signals are never delayed, even for a child still joining its group:
a stop request must be prompt, and a single process would stop the same way.

Exit and restart policy
-----------------------
A child *dies unexpectedly* when it exits while the parent is not stopping
and it was not a normal ``--until-idle`` finish (exit 0). Then:

- **killed by a signal** (OOM killer, SIGKILL, a segfault), or exit 0 / 130
  without ``--until-idle`` (someone signalled the child directly): with
  ``restart=True`` (the CLI's choice) it is restarted under the same index,
  after a backoff of ``backoff_s`` doubling per recent death up to
  ``max_backoff_s``. Its uncommitted records are re-read by whichever member
  gets its partitions (at-least-once, idempotent upserts), so a restart loses
  nothing. More than ``max_restarts`` deaths of one child within
  ``restart_window_s`` is a crash loop: the parent gives up, stops the others
  and exits 1 (the orchestrator sees it). With ``restart=False`` such a death
  stops the others and exits 1.
- **exit 1, 2, 3 or any other code**: the child reported a failure that a
  restart would only repeat (retries exhausted, DLQ guard tripped — which
  exists to stop the pipeline for a human —, invalid configuration, a service
  unreachable at start, an unexpected exception). As in a single process where
  one failed pipeline stops the others: the parent stops the other children
  cleanly and exits with that code (2 and 3 kept, anything else 1).

A supervisor-initiated stop (after a failure) spares children that may still
be joining their group: a child younger than ``join_grace_s`` gets its SIGTERM
once it reaches that age (the CLI derives it from the consumer's
``session.timeout.ms``). On some brokers (the Tansu test broker) a consumer
that leaves before its first assignment wedges the group; Apache Kafka copes,
but nothing is lost by waiting.

Exit code: once every child has exited, the highest exit code among the
children's last incarnations (a death by signal counts as 1, or 130 when the
parent SIGKILLed it after an abort; codes other than 0/1/2/3/130 count as 1;
a child whose restart was cancelled by a stop keeps its death, 1) and the failure code that
started a supervisor stop, if any. So 0 when every child stopped cleanly, 130
when a second signal aborted them. With ``--until-idle`` the parent exits when
all children have finished.

Layout
------
- :mod:`.policy`   -- exit codes and the restart decision (pure: no processes);
- :mod:`.children` -- one child: its command line, environment, start, signal;
- :mod:`.loop`     -- :class:`Supervisor`: signals, reaping, deferred stops, kills;
- :mod:`.summary`  -- the children's ``--summary-json`` documents merged into one.
"""

from __future__ import annotations

from ingest.supervisor.children import (
           PER_CHILD_OPTIONS,
           child_argv,
           join_grace_from_client,
)
from ingest.supervisor.loop import Supervisor, run_from_cli, supervise
from ingest.supervisor.summary import merge_summaries

__all__ = ["PER_CHILD_OPTIONS", "Supervisor", "child_argv", "join_grace_from_client", "merge_summaries",
           "run_from_cli", "supervise"]
