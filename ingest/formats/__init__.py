"""Formats: decoders from record bytes to documents, one module per format, found by ``format:`` in
:mod:`.registry` (:mod:`.base` is the port; :mod:`.json` is ``format: json``)."""
