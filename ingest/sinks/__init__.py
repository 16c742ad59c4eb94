"""Sink adapters: one file per database backend.

Every sink implements the :class:`ingest.sinks.base.Sink` contract: ``write``
takes already-deduplicated rows and writes them in one transaction, raising
:class:`~ingest.errors.TransientError` or :class:`~ingest.errors.PermanentError`
and nothing else.
"""
