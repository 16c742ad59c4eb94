"""A Confluent Schema Registry stand-in: the REST subset clients use, over real HTTP, with faults.

No Schema Registry server installs on these machines (see INFRA.md: Confluent's
is a Java service with no package; karapace is not on the index), so the tests
run this one. It speaks the registry's JSON shapes closely enough that
confluent-kafka's own ``SchemaRegistryClient`` and serializers work against it
unmodified, so the bytes the tests produce are the real wire format:

- ``POST /subjects/{s}/versions`` → ``{"id", "guid", "subject", "version", "schema", "schemaType"}``; one id
  per distinct (type, schema text) across subjects, as the registry does;
- ``GET /schemas/ids/{id}`` and ``/schemas/guids/{guid}`` (``?format=serialized`` returns what was
  registered, which for Protobuf from confluent-kafka is already the serialized descriptor);
- ``GET /subjects``, ``/subjects/{s}/versions``, ``/subjects/{s}/versions/{v|latest}``;
- ``POST /subjects/{s}`` (lookup); ``GET /associations/resources/-/{topic}`` (``[]``: topic-name subjects);
- errors as ``{"error_code": 40403, "message": ...}`` (schema), ``40401`` (subject), ``40402`` (version).

Faults (:meth:`SchemaRegistryStandIn.fault`): ``None`` (serve), ``"503"``/``"500"``/``"429"``/``"408"``/
``"401"``/``"403"`` (every request answers that status), ``"empty"`` (every lookup answers
not-found, as a wrong URL or an empty registry would), ``"drop"`` (the connection is closed
without an answer). :meth:`stop` / :meth:`start` take the port down and bring it back (connection
refused meanwhile). :meth:`hide` makes one id answer not-found (as if it were deleted, or
registered only later) until :meth:`reveal`. ``requests`` counts requests per path kind, so tests
can check caching.

Optional basic auth (``user``/``password``): any other or missing credentials answer 401.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import re
import socket
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse


@dataclass
class _Stored:
    id: int
    guid: str
    schema: str
    schema_type: str
    references: list[dict[str, Any]] = field(default_factory=list)


class SchemaRegistryStandIn:
    """A threaded HTTP server on 127.0.0.1 (an ephemeral port unless ``port``); see the module docstring."""

    def __init__(self, *, user: str | None = None, password: str | None = None, port: int = 0) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[int, _Stored] = {}
        self._by_text: dict[tuple[str, str], _Stored] = {}
        self._subjects: dict[str, list[int]] = {}
        self._auth = None if user is None else "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.requests: collections.Counter[str] = collections.Counter()
        self._fault: str | None = None
        self._hidden: set[int] = set()
        self._connections: set[Any] = set()
        self._port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.start()

    # -- lifecycle -------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        registry = self

        class Handler(_Handler):
            owner = registry

        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="schema-registry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the port (connections are refused until :meth:`start`); the schemas are kept."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:  # kept-alive connections too: a stopped registry answers nothing
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def fault(self, kind: str | None) -> None:
        """Inject a fault for every request from now on (``None`` to heal); see the module docstring."""
        self._fault = kind

    # -- direct access for tests ------------------------------------------------------
    def register(self, subject: str, schema: str, schema_type: str = "AVRO",
                 references: list[dict[str, Any]] | None = None) -> int:
        """Register ``schema`` under ``subject`` as a client would; returns its id."""
        return self._register(subject, schema, schema_type.upper(), references or []).id

    def hide(self, schema_id: int) -> None:
        """``schema_id`` answers not-found (40403) until :meth:`reveal`."""
        self._hidden.add(schema_id)

    def reveal(self, schema_id: int) -> None:
        self._hidden.discard(schema_id)

    def schema(self, schema_id: int) -> str:
        return self._by_id[schema_id].schema

    # -- the registry's logic -----------------------------------------------------------
    def _register(self, subject: str, schema: str, schema_type: str, references: list[dict[str, Any]]) -> _Stored:
        with self._lock:
            key = (schema_type, schema)
            stored = self._by_text.get(key)
            if stored is None:
                stored = _Stored(len(self._by_id) + 1, str(uuid.uuid4()), schema, schema_type, references)
                self._by_id[stored.id] = stored
                self._by_text[key] = stored
            versions = self._subjects.setdefault(subject, [])
            if stored.id not in versions:
                versions.append(stored.id)
            return stored

    def _body(self, stored: _Stored, subject: str | None = None, version: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": stored.id, "guid": stored.guid, "schema": stored.schema}
        if stored.schema_type != "AVRO":
            out["schemaType"] = stored.schema_type
        if stored.references:
            out["references"] = stored.references
        if subject is not None:
            out["subject"] = subject
            out["version"] = version
        return out

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> tuple[int, Any]:
        """One request → (status, JSON body). Pure routing over the stored schemas."""
        fault = self._fault
        if fault is not None and fault.isdigit():
            return int(fault), {"error_code": int(fault), "message": f"injected HTTP {fault}"}
        empty = fault == "empty"
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["associations", "resources"]:
            self.requests["associations"] += 1
            return 200, []
        if parts[:2] == ["schemas", "ids"] and len(parts) == 3 and method == "GET":
            self.requests["schemas/ids"] += 1
            hidden = not parts[2].isdigit() or int(parts[2]) in self._hidden
            stored = None if empty or hidden else self._by_id.get(int(parts[2]))
            if stored is None:
                return 404, {"error_code": 40403, "message": f"Schema {parts[2]} not found"}
            return 200, self._body(stored)
        if parts[:2] == ["schemas", "guids"] and len(parts) == 3 and method == "GET":
            self.requests["schemas/guids"] += 1
            stored = None if empty else next((s for s in self._by_id.values() if s.guid == parts[2]), None)
            if stored is None:
                return 404, {"error_code": 40403, "message": f"Schema {parts[2]} not found"}
            return 200, self._body(stored)
        if parts == ["subjects"] and method == "GET":
            self.requests["subjects"] += 1
            return 200, [] if empty else sorted(self._subjects)
        if parts and parts[0] == "subjects" and len(parts) >= 2:
            return self._subject(method, parts, body, empty)
        return 404, {"error_code": 404, "message": f"no route {method} {path}"}

    def _subject(self, method: str, parts: list[str], body: Any, empty: bool) -> tuple[int, Any]:
        subject = parts[1]
        versions = [] if empty else self._subjects.get(subject, [])
        if len(parts) == 3 and parts[2] == "versions" and method == "POST":
            self.requests["register"] += 1
            stored = self._register(subject, body["schema"], body.get("schemaType", "AVRO").upper(),
                                    body.get("references") or [])
            return 200, self._body(stored, subject, self._subjects[subject].index(stored.id) + 1)
        if len(parts) == 2 and method == "POST":  # lookup: is this schema registered under the subject?
            self.requests["lookup"] += 1
            stored = self._by_text.get((body.get("schemaType", "AVRO").upper(), body["schema"]))
            if not versions:
                return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
            if stored is None or stored.id not in versions:
                return 404, {"error_code": 40403, "message": "Schema not found"}
            return 200, self._body(stored, subject, versions.index(stored.id) + 1)
        if not versions:
            return 404, {"error_code": 40401, "message": f"Subject '{subject}' not found."}
        if len(parts) == 3 and parts[2] == "versions" and method == "GET":
            self.requests["versions"] += 1
            return 200, list(range(1, len(versions) + 1))
        if len(parts) == 4 and parts[2] == "versions" and method == "GET":
            self.requests["version"] += 1
            v = parts[3]
            index = len(versions) if v in ("latest", "-1") else (int(v) if re.fullmatch(r"\d+", v) else 0)
            if not 1 <= index <= len(versions):
                return 404, {"error_code": 40402, "message": f"Version {v} not found."}
            return 200, self._body(self._by_id[versions[index - 1]], subject, index)
        return 404, {"error_code": 404, "message": "no such subject route"}


class _Handler(BaseHTTPRequestHandler):
    owner: SchemaRegistryStandIn
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _serve(self, method: str) -> None:
        owner = self.owner
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if owner._fault == "drop":
            self.close_connection = True
            self.connection.close()
            return
        if owner._auth is not None and self.headers.get("Authorization") != owner._auth:
            status, body = 401, {"error_code": 40101, "message": "Unauthorized"}
        else:
            url = urlparse(self.path)
            try:
                status, body = owner.handle(method, url.path, parse_qs(url.query), json.loads(raw) if raw else None)
            except (KeyError, ValueError, TypeError) as exc:
                status, body = 422, {"error_code": 42201, "message": f"invalid request: {exc}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._serve("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")
