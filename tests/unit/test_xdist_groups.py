"""The suite's parallel run keeps ``xdist_group`` tests together on one worker, in file order.

``scripts/test.sh`` runs pytest-xdist with ``--dist loadgroup``; a few tests depend on it (a
module-scoped run shared by the tests of ``test_poison_dlq.py``, the chaos cases, a check that runs
after a differential test and reads its counter). pytest 9.2 broke the grouping silently: the tests
were spread over workers as if unmarked (pytest-xdist #1386). This runs a tiny suite the way
``scripts/test.sh`` runs the real one and reads back which worker ran what.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

def _suite(grouped: int = 6, free: int = 6) -> str:
    """``grouped`` tests in one group, each checking that every earlier one ran before it in its
    process, interleaved with ``free`` unmarked tests."""
    lines = ["import pytest", "", "RAN = []", ""]
    for i in range(max(grouped, free)):
        if i < grouped:
            lines += ['@pytest.mark.xdist_group("together")', f"def test_grouped_{i}():",
                      f"    assert RAN == list(range({i})), RAN", f"    RAN.append({i})", ""]
        if i < free:
            lines += [f"def test_free_{i}():", "    pass", ""]
    return "\n".join(lines)


@pytest.mark.timeout(120)
def test_grouped_tests_run_on_one_worker_in_file_order(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(_suite())
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
         "-o", "addopts=", str(tmp_path / "test_grouped.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=110,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    ran = [line for line in res.stdout.splitlines() if "PASSED" in line and "::test_grouped_" in line]
    assert len(ran) == 6, res.stdout[-3000:]
    workers = {line.split("]")[0].lstrip("[") for line in ran}
    assert len(workers) == 1, f"grouped tests ran on workers {workers}\n{res.stdout[-3000:]}"
