"""``python -m ingest`` == the ``ingest`` console script."""

from ingest.cli import main

main()
