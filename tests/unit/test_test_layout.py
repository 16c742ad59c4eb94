"""The suite's own layout rule: test module basenames are unique across tests/.

tests/ has no ``__init__.py`` files (the harness is imported as a top-level
package), so pytest imports test modules by basename; two files with the same
name in different folders break collection of the whole run.
"""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
