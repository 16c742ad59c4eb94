"""Run ``ingest`` with each Python thread's OS name set to its ``threading`` name (Linux).

    python bench/thread_names.py run -c config.yaml ...   # == ingest run -c config.yaml ...

CPython 3.11 leaves every thread of a process named after the process, so ``/proc/<pid>/task``
cannot tell the pipeline thread from a lane. This shim names each thread as it starts (the first
15 bytes of its ``threading`` name: ``pipeline-bench``, ``bench-lane-0``, ``bench-dlq_0``) and then
runs ingest's own command line, unchanged otherwise. librdkafka names its threads itself
(``rdk:main``, ``rdk:broker1``...). Used by ``bench/hot_path_profile.py``; bench-only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from pathlib import Path

#: prctl(2) option: set the calling thread's name (at most 15 bytes and a NUL).
PR_SET_NAME = 15


def install() -> None:
    """Name every thread started from now on after its ``threading`` name (no-op without prctl)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if not hasattr(libc, "prctl"):
        return
    bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named_bootstrap(self: threading.Thread) -> None:
        libc.prctl(PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
        bootstrap(self)

    threading.Thread._bootstrap_inner = named_bootstrap  # type: ignore[attr-defined]


if __name__ == "__main__":
    install()
    # the repository instead of bench/ (whose scripts' names must not shadow modules ingest imports)
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    from ingest.cli import main

    sys.argv[0] = "ingest"
    main()
