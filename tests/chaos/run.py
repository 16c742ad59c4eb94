#!/usr/bin/env python3
"""Run the chaos cases outside pytest: ``python tests/chaos/run.py [--long] [--case NAME ...] [--seed N]``.

Same as ``python -m tests.chaos.runner`` from the repository root; see runner.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
