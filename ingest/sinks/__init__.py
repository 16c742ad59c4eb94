"""Sinks: one package per database kind, found by ``sink.kind`` in :mod:`.registry`.

:mod:`.base` is the port every kind implements (:class:`~.base.SinkBackend` per kind,
:class:`~.base.Sink` per pipeline, :class:`~.base.Capabilities` declared, never probed).
A new sink kind is a settings class, one package, and one registry line.
"""
