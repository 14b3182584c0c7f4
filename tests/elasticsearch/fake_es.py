"""A local HTTP server that answers as Elasticsearch 9 does, scripted per test.

It runs in a thread (``http.server``) on ``127.0.0.1:0``; the real ``AsyncElasticsearch``
client talks to it over a socket, in plain HTTP or, with ``tls`` (a server context: the
certificates of ``tests/certs.py``), over TLS; :meth:`FakeElasticsearch.restart_with` serves
another certificate (one rotated, or expired) from the next connection on, closing the open ones
as a node's restart does. Every answer of Elasticsearch carries ``X-Elastic-Product:
Elasticsearch`` (every REST answer since 7.14: ``RestController``; the client refuses a first
successful answer without it) and the content type ES 9 answers to the client's
``compatible-with=9`` accept header. A proxy's page (:func:`proxy_page`) carries neither.

A test queues answers (``fake.on(method, path, status, body)``: FIFO, each used once; ``body``
may be a function of the request), calls the store, then reads ``fake.requests``. A request with
no answer queued is answered 400 and kept in ``fake.unexpected`` (the fixture asserts it empty),
unless ``fake.model`` is set: an :class:`EsModel`, a stateful Elasticsearch 9 for the APIs the
sink uses (see the section at the end), answers it then. Several clients (replicas) may share
one fake: the model answers each request under its own lock, which a request waiting on the
cluster (a primary that is not active) lets go meanwhile.

Before any answer, the server enforces the HTTP limits of a node with default settings: a
request line over ``http.max_initial_line_length`` (4 KB) is a 400
``too_long_http_line_exception``, a body over ``http.max_content_length`` (100 MB;
``max_content_length`` here) a 413 with no body.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import json
import re
import socket
import ssl
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

CONTENT_TYPE = "application/vnd.elasticsearch+json;compatible-with=9"
MAX_INITIAL_LINE = 4096
MAX_CONTENT_LENGTH = 100 * 1024 * 1024
MAX_CLAUSE_COUNT = 1024
"""The floor of the clause limit ES 9 computes from the heap and the search threads."""
MAX_KEYWORD_BYTES = 32766
LUCENE_MAX_DOCS = 2_147_483_519
"""``IndexWriter.MAX_DOCS``: the documents a shard holds at most, nested and deleted ones counted
(reference: troubleshoot/elasticsearch/... "Number of documents in the shard cannot exceed")."""


@dataclass(frozen=True)
class Raw:
    """An answer body sent as it is (a proxy's page, an empty body), with its content type
    (``"auto"``: the one Elasticsearch gives the request's accept header), the product header
    or not (a proxy's page has none) and any other headers."""

    data: bytes
    content_type: str | None = None
    product: bool = True
    headers: tuple[tuple[str, str], ...] = ()


def proxy_page(status: int) -> Raw:
    """The error page a reverse proxy (nginx) sends in place of Elasticsearch's answer: HTML,
    without Elasticsearch's product header (``ngx_http_special_response.c``: "<center><h1>502
    Bad Gateway</h1></center>" and the server's name)."""
    titles = {
        404: "404 Not Found",
        405: "405 Not Allowed",
        408: "408 Request Time-out",
        413: "413 Request Entity Too Large",
        502: "502 Bad Gateway",
        503: "503 Service Temporarily Unavailable",
        504: "504 Gateway Time-out",
    }
    title = titles[status]
    page = (
        f"<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n<center><h1>{title}</h1></center>\r\n"
        "<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
    )
    return Raw(page.encode(), "text/html", product=False)


@dataclass(frozen=True)
class Recorded:
    """One request as the fake received it."""

    method: str
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def ndjson(self) -> list[Any]:
        # lines end at "\n" only (reference: rest-apis/bulk, "NDJSON"): a JSON string may hold
        # U+2028, U+0085 or U+001E as they are, which str.splitlines would split at
        return [json.loads(line) for line in self.body.decode().split("\n") if line.strip()]


Body = Any | Callable[[Recorded], Any]


@dataclass
class _Answer:
    method: str
    path: re.Pattern[str]
    status: int
    body: Body


class _Server(ThreadingHTTPServer):
    """The HTTP server, wrapping each connection in the fake's TLS context of the moment."""

    daemon_threads = True
    fake: FakeElasticsearch

    def finish_request(self, request: Any, client_address: Any) -> None:
        fake = self.fake
        ctx = fake.tls
        conn = request
        if ctx is not None:
            try:
                conn = ctx.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return  # the client refused the certificate (or the other way round)
        with fake._lock:
            fake._connections.add(conn)
        try:
            super().finish_request(conn, client_address)
        finally:
            with fake._lock:
                fake._connections.discard(conn)
            if conn is not request:
                conn.close()


@dataclass
class FakeElasticsearch:
    requests: list[Recorded] = field(default_factory=list)
    unexpected: list[Recorded] = field(default_factory=list)
    model: EsModel | None = None
    """When set, answers every request no queued answer matched (a stateful Elasticsearch)."""
    max_content_length: int = MAX_CONTENT_LENGTH
    tls: ssl.SSLContext | None = None
    """The server's TLS context (None: plain HTTP); read at each new connection."""
    proxy: tuple[str, int, Raw] | None = None
    """A proxy in front of the node answers the requests whose path matches (a regular
    expression) with this status and page (:func:`proxy_page`) instead of passing them on."""
    _answers: list[_Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _connections: set[Any] = field(default_factory=set)

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"{'https' if self.tls is not None else 'http'}://{host!s}:{port}"

    def on(self, method: str, path: str, status: int = 200, body: Body = None) -> None:
        """Queues one answer to the next ``method`` request whose path fully matches ``path`` (a
        regular expression)."""
        with self._lock:
            self._answers.append(_Answer(method, re.compile(path), status, body))

    def pending(self) -> list[str]:
        """Answers queued and not used (a test asserts none is left)."""
        with self._lock:
            return [f"{a.method} {a.path.pattern}" for a in self._answers]

    def take(self) -> list[Recorded]:
        """The requests received so far (and forgets them)."""
        with self._lock:
            out, self.requests = self.requests, []
            return out

    def restart_with(self, tls: ssl.SSLContext) -> None:
        """The node restarts with another certificate (rotated, or expired): the connections open
        are closed, and the next ones are served with ``tls``."""
        with self._lock:
            self.tls = tls
            open_ = list(self._connections)
        for conn in open_:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _answer(self, req: Recorded) -> tuple[int, Any]:
        status, body = self._answer_unfiltered(req)
        if "filter_path" in req.params and isinstance(body, dict) and "error" not in body:
            body = filter_path(body, req.params["filter_path"])  # an error answer is never filtered
        return status, body

    def _answer_unfiltered(self, req: Recorded) -> tuple[int, Any]:
        with self._lock:
            self.requests.append(req)
            if self.proxy is not None and re.fullmatch(self.proxy[0], req.path):
                return self.proxy[1], self.proxy[2]
            for i, a in enumerate(self._answers):
                if a.method == req.method and a.path.fullmatch(req.path):
                    del self._answers[i]
                    body = a.body(req) if callable(a.body) else a.body
                    return a.status, body
            model = self.model
            if model is None:
                self.unexpected.append(req)
        if model is not None:
            return model.answer(req)  # under the model's own lock
        return 400, error(400, "illegal_argument_exception", f"fake: no answer for {req.method} {req.path}")

    def start(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def _handle(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                req = Recorded(
                    method=self.command,
                    path=parts.path,
                    params=dict(parse_qsl(parts.query, keep_blank_values=True)),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=raw,
                )
                body: Any
                if len(self.requestline.encode("latin-1")) > MAX_INITIAL_LINE:
                    with fake._lock:
                        fake.requests.append(req)
                    reason = f"An HTTP line is larger than {MAX_INITIAL_LINE} bytes."
                    status, body = 400, error(400, "too_long_http_line_exception", reason)
                elif length > fake.max_content_length:
                    with fake._lock:
                        fake.requests.append(req)
                    status, body = 413, Raw(b"")
                else:
                    status, body = fake._answer(req)
                # the media type asked for: compatible-with=9 for the client's, else plain JSON
                compat = "compatible-with" in req.headers.get("accept", "")
                content_type: str | None = CONTENT_TYPE if compat else "application/json"
                product, extra = True, ()
                if isinstance(body, Raw):
                    data, product, extra = body.data, body.product, body.headers
                    content_type = content_type if body.content_type == "auto" else body.content_type
                else:
                    data = b"" if body is None else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    if product:
                        self.send_header("X-Elastic-Product", "Elasticsearch")
                    for name, value in extra:
                        self.send_header(name, value)
                    if content_type is not None:
                        self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
                    self.close_connection = True  # the client gave up (a timeout test)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = _Server(("127.0.0.1", 0), Handler)
        server.fake = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.01,), name="fake-es", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self.model is not None:
            self.model.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def running() -> Iterator[FakeElasticsearch]:
    fake = FakeElasticsearch()
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


# --------------------------------------------------------------------------- ES 9 answers

_DROP = object()


def filter_path(body: dict[str, Any], spec: str) -> dict[str, Any]:
    """``filter_path`` as ES applies it to an answer: comma-separated dotted paths, ``*`` for any
    one key, arrays crossed as if absent, and objects left empty dropped."""
    patterns = [p.split(".") for p in spec.split(",") if p]

    def keep(value: Any, pats: list[list[str]]) -> Any:
        if isinstance(value, list):
            kept = [x for x in (keep(v, pats) for v in value) if x is not _DROP]
            return kept if kept else _DROP
        if not isinstance(value, dict):
            return _DROP
        out = {}
        for k, v in value.items():
            sub = [p[1:] for p in pats if p and fnmatch.fnmatchcase(k, p[0])]
            if any(not p for p in sub):
                out[k] = v
            elif sub:
                r = keep(v, sub)
                if r is not _DROP:
                    out[k] = r
        return out if out else _DROP

    kept = keep(body, patterns)
    return {} if kept is _DROP else kept


def api_key_header(key: str) -> str:
    """The ``Authorization`` value a client sends for an API key given as one string (its
    ``id:key`` encoded): ``ApiKey <key>`` (reference: security-api-create-api-key, "encoded")."""
    return f"ApiKey {key}"


def basic_header(user: str, password: str) -> str:
    """The ``Authorization`` value of a user and password (HTTP basic authentication)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def error(status: int, type: str, reason: str, **extra: Any) -> dict[str, Any]:
    """An error answer as ES gives it: ``{"error": {root_cause, type, reason}, "status"}``."""
    cause = {"type": type, "reason": reason, **extra}
    return {"error": {"root_cause": [cause], **cause}, "status": status}


ITEM_ERRORS: dict[int, dict[str, str]] = {
    # a value the mapping cannot take (DocumentParser: DocumentParsingException, 400)
    400: {"type": "document_parsing_exception", "reason": "[1:2] failed to parse field [version] of type [long]"},
    # index.blocks.write: the block of IndexMetadata.INDEX_WRITE_BLOCK (id 8, not retryable:
    # ClusterBlockException.status() 403); reference: index-settings/index-block.md
    403: {"type": "cluster_block_exception", "reason": "index [{index}] blocked by: [FORBIDDEN/8/index write (api)];"},
    # action.auto_create_index refusing the index (TransportBulkAction: IndexNotFoundException, 404)
    404: {"type": "index_not_found_exception", "reason": "no such index [{index}]"},
    # a primary that is not assigned (ReplicationOperation: UnavailableShardsException, 503)
    503: {"type": "unavailable_shards_exception", "reason": "[{index}][0] primary shard is not active"},
}
"""The error of a failed bulk item per status, as ES 9 gives it (each from the source file named)."""


def bulk_answer(*statuses: int, first_seq_no: int = 100) -> Callable[[Recorded], dict[str, Any]]:
    """A ``_bulk`` answer: one ``create`` item per action line of the request, with the given
    statuses in order (201 created, 409 exists, 429 rejected, 400 mapping error, ...). The items
    created are numbered from ``first_seq_no`` (an index holding documents already; 0 is a new
    shard's first document)."""

    def answer(req: Recorded) -> dict[str, Any]:
        index = req.path.strip("/").split("/")[0]
        actions = req.ndjson()[::2]
        assert len(actions) == len(statuses), f"{len(actions)} actions, {len(statuses)} statuses scripted"
        items = []
        for n, (action, status) in enumerate(zip(actions, statuses, strict=True)):
            _id = action["create"]["_id"]
            item: dict[str, Any] = {"_index": index, "_id": _id, "status": status}
            if status == 201:
                item.update(
                    _version=1,
                    result="created",
                    _shards={"total": 2, "successful": 1, "failed": 0},
                    _seq_no=first_seq_no + n,
                    _primary_term=1,
                )
            elif status == 409:
                item["error"] = {
                    "type": "version_conflict_engine_exception",
                    "reason": f"[{_id}]: version conflict, document already exists (current version [1])",
                    "index_uuid": "aBcD1234",
                    "shard": "0",
                    "index": index,
                }
            elif status == 429:
                item["error"] = {
                    "type": "es_rejected_execution_exception",
                    "reason": "rejected execution of coordinating operation",
                }
            elif status in ITEM_ERRORS:
                item["error"] = {k: v.format(index=index) for k, v in ITEM_ERRORS[status].items()}
            else:
                raise AssertionError(f"fake: no item error is scripted for status {status}")
            items.append({"create": item})
        errors = any(s >= 300 for s in statuses)
        return {"errors": errors, "took": 3, "items": items}

    return answer


@dataclass
class Held:
    """An answer held back until the test sets ``released`` (a node slower than the client's
    timeout). ``reached`` is set when the request has arrived and taken its queued answer, so a
    test can wait for that before it ends instead of racing the server's thread."""

    answer: Callable[[Recorded], Any]
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def __call__(self, req: Recorded) -> Any:
        self.reached.set()
        self.released.wait(10)
        return self.answer(req)


def ubq_answer(*, updated: int = 0, noops: int = 0, version_conflicts: int = 0, failures: Any = ()) -> dict[str, Any]:
    """An ``_update_by_query`` answer."""
    return {
        "took": 7,
        "timed_out": False,
        "total": updated + noops + version_conflicts,
        "updated": updated,
        "deleted": 0,
        "batches": 1,
        "version_conflicts": version_conflicts,
        "noops": noops,
        "retries": {"bulk": 0, "search": 0},
        "throttled_millis": 0,
        "requests_per_second": -1.0,
        "throttled_until_millis": 0,
        "failures": list(failures),
    }


def hits(index: str, sources: list[dict[str, Any]]) -> dict[str, Any]:
    """A search answer holding these documents."""
    return {
        "took": 1,
        "timed_out": False,
        "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
        "hits": {
            "total": {"value": len(sources), "relation": "eq"},
            "max_score": None,
            "hits": [
                {
                    "_index": index,
                    "_id": f"doc-{i}",
                    "_score": None,
                    "_routing": s.get("aggregate_id"),
                    "_source": s,
                    "sort": [s.get("version")],
                }
                for i, s in enumerate(sources)
            ],
        },
    }


def msearch_answer(*responses: dict[str, Any]) -> dict[str, Any]:
    return {"took": 2, "responses": [{**r, "status": r.get("status", 200)} for r in responses]}


def health(index: str, status: str = "yellow", timed_out: bool = False) -> dict[str, Any]:
    return {
        "cluster_name": "fake",
        "status": status,
        "timed_out": timed_out,
        "number_of_nodes": 1,
        "number_of_data_nodes": 1,
        "active_primary_shards": 0 if status == "red" else 1,
        "active_shards": 0 if status == "red" else 1,
        "relocating_shards": 0,
        "initializing_shards": 0,
        "unassigned_shards": 1 if status != "green" else 0,
        "unassigned_primary_shards": 1 if status == "red" else 0,
        "delayed_unassigned_shards": 0,
        "number_of_pending_tasks": 0,
        "number_of_in_flight_fetch": 0,
        "task_max_waiting_in_queue_millis": 0,
        "active_shards_percent_as_number": 50.0,
    }


def created(index: str) -> dict[str, Any]:
    return {"acknowledged": True, "shards_acknowledged": True, "index": index}


def refreshed() -> dict[str, Any]:
    return {"_shards": {"total": 2, "successful": 1, "failed": 0}}


def ubq_status(answer: dict[str, Any]) -> int:
    """The HTTP status Elasticsearch sends an ``_update_by_query`` answer with
    (``BulkIndexByScrollResponseContentListener``): 200, 408 when it timed out, else the highest
    status of its failures."""
    status = 408 if answer.get("timed_out") else 200
    return max([status, *(int(f["status"]) for f in answer.get("failures", []))])


def bulk_failure(index: str, _id: str, status: int, type: str, reason: str) -> dict[str, Any]:
    """A bulk failure of an ``_update_by_query`` answer."""
    return {"index": index, "id": _id, "cause": {"type": type, "reason": reason, "index": index}, "status": status}


def search_failure(index: str, status: int, type: str, reason: str) -> dict[str, Any]:
    """A search (shard) failure of an ``_update_by_query`` answer."""
    return {"index": index, "shard": 0, "node": "n1", "status": status, "reason": {"type": type, "reason": reason}}


def script_error(reason: str, cause_type: str, cause_reason: str) -> dict[str, Any]:
    """The 400 error body of a painless script that failed at run time."""
    return {
        "error": {
            "root_cause": [{"type": "script_exception", "reason": reason}],
            "type": "script_exception",
            "reason": reason,
            "script_stack": ["..."],
            "script": "...",
            "lang": "painless",
            "position": {"offset": 0, "start": 0, "end": 1},
            "caused_by": {"type": cause_type, "reason": cause_reason},
        },
        "status": 400,
    }


def stored_mapping(mapping: dict[str, Any]) -> dict[str, Any]:
    """A mapping as ``GET <index>/_mapping`` shows it: ``dynamic`` as a string, ``"type":
    "object"`` only on objects without properties, properties in name order."""

    def field_(spec: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        kind = spec.get("type", "object")
        if "properties" in spec:
            if kind != "object":
                out["type"] = kind
        else:
            out["type"] = kind
        for k, v in spec.items():
            if k in ("type", "properties"):
                continue
            out[k] = str(v).lower() if k == "dynamic" else v
        if "properties" in spec:
            out["properties"] = {k: field_(v) for k, v in sorted(spec["properties"].items())}
        return out

    out: dict[str, Any] = {}
    for k, v in mapping.items():
        if k == "properties":
            continue
        out[k] = str(v).lower() if k == "dynamic" else v
    out["properties"] = {k: field_(v) for k, v in sorted(mapping.get("properties", {}).items())}
    return out


# --------------------------------------------------------------------------- a stateful ES 9
#
# ``EsModel`` answers as one Elasticsearch 9 node with one shard per index would, for the APIs
# the sink uses: index creation (mapping kept and enforced: strict/false dynamic, disabled
# objects, routing required), bulk creates (201/409 by id), refresh visibility (a search sees
# documents as of the last refresh), search/msearch (bool/term/range/exists, sort, size,
# search_after, _source filtering, routing), update_by_query (over the last refresh, a
# document changed since is a version conflict; the script run by the painless subset below;
# failures and status as ES gives them) and cluster health. It refuses unknown parameters and
# body keys with ES's 400s, so a request only this model accepts does not pass unnoticed.


class _ApiFailure(Exception):
    def __init__(self, status: int, type: str, reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.status, self.type, self.reason, self.extra = status, type, reason, extra


class ScriptError(Exception):
    """A painless run-time error (``caused_by`` type and reason)."""

    def __init__(self, type: str, reason: str) -> None:
        super().__init__(reason)
        self.type, self.reason = type, reason


_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+)|(?P<str>'(?:[^'\\]|\\.)*')|(?P<id>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>==|!=|<=|>=|\|\||&&|[<>!?:;=.(){}\[\]]))"
)


class Painless:
    """The subset of painless the sink's scripts use: ``def`` locals, ``if``/``else`` blocks,
    assignments to map members, ``== != < > <= >= || && !``, ``?:``, ``.`` and ``[]`` on maps
    (a missing key is null; either on null is a NullPointerException), ``null``/``true``/
    ``false``, integers and single-quoted strings. Numbers compare by value across int/long
    (painless ``DefMath``); ordering a null or a non-number is an error, as in painless."""

    def __init__(self, source: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = source.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise ValueError(f"painless: cannot read {text[pos : pos + 20]!r}")
            kind = m.lastgroup
            assert kind is not None
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0
        self.program = self._statements(until=None)

    # ---- parsing (into nested tuples)

    def _peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def _next(self, expect: str | None = None) -> tuple[str, str]:
        if self.i >= len(self.tokens):
            raise ValueError(f"painless: unexpected end, expected {expect}")
        tok = self.tokens[self.i]
        if expect is not None and tok[1] != expect:
            raise ValueError(f"painless: expected {expect!r}, got {tok[1]!r}")
        self.i += 1
        return tok

    def _statements(self, until: str | None) -> list[Any]:
        out = []
        while self._peek() != until:
            out.append(self._statement())
        return out

    def _block(self) -> list[Any]:
        if self._peek() == "{":
            self._next("{")
            body = self._statements(until="}")
            self._next("}")
            return body
        return [self._statement()]

    def _statement(self) -> Any:
        if self._peek() == "def":
            self._next()
            kind, name = self._next()
            if kind != "id":
                raise ValueError(f"painless: a name must follow def, got {name!r}")
            self._next("=")
            value = self._expr()
            self._next(";")
            return ("def", name, value)
        if self._peek() == "if":
            self._next()
            self._next("(")
            cond = self._expr()
            self._next(")")
            then = self._block()
            other: list[Any] = []
            if self._peek() == "else":
                self._next()
                other = self._block()
            return ("if", cond, then, other)
        target = self._postfix()
        if target[0] not in ("member", "index", "var"):
            raise ValueError("painless: not an assignable expression")
        self._next("=")
        value = self._expr()
        self._next(";")
        return ("set", target, value)

    def _expr(self) -> Any:
        cond = self._binary(0)
        if self._peek() == "?":
            self._next()
            a = self._expr()
            self._next(":")
            b = self._expr()
            return ("?:", cond, a, b)
        return cond

    _LEVELS = (("||",), ("&&",), ("==", "!="), ("<", ">", "<=", ">="))

    def _binary(self, level: int) -> Any:
        if level == len(self._LEVELS):
            return self._unary()
        left = self._binary(level + 1)
        while self._peek() in self._LEVELS[level] and self.tokens[self.i][0] == "op":
            op = self._next()[1]
            left = (op, left, self._binary(level + 1))
        return left

    def _unary(self) -> Any:
        if self._peek() == "!":
            self._next()
            return ("!", self._unary())
        return self._postfix()

    def _postfix(self) -> Any:
        node = self._primary()
        while self._peek() in (".", "["):
            if self._next()[1] == ".":
                kind, name = self._next()
                if kind != "id":
                    raise ValueError(f"painless: a name must follow '.', got {name!r}")
                node = ("member", node, name)
            else:
                key = self._expr()
                self._next("]")
                node = ("index", node, key)
        return node

    def _primary(self) -> Any:
        kind, text = self._next()
        if kind == "num":
            return ("const", int(text))
        if kind == "str":
            return ("const", text[1:-1].replace("\\'", "'"))
        if text == "(":
            e = self._expr()
            self._next(")")
            return e
        if kind == "id":
            if text in ("null", "true", "false"):
                return ("const", {"null": None, "true": True, "false": False}[text])
            return ("var", text)
        raise ValueError(f"painless: unexpected {text!r}")

    # ---- running

    def run(self, params: dict[str, Any], ctx: dict[str, Any]) -> None:
        scope: dict[str, Any] = {"params": params, "ctx": ctx}
        self._run(self.program, scope)

    def _run(self, stmts: list[Any], scope: dict[str, Any]) -> None:
        for st in stmts:
            if st[0] == "def":
                if st[1] in scope:
                    raise ScriptError("illegal_argument_exception", f"variable [{st[1]}] is already defined")
                scope[st[1]] = self._eval(st[2], scope)
            elif st[0] == "if":
                self._run(st[2] if self._bool(self._eval(st[1], scope)) else st[3], dict(scope))
            else:
                target, value = st[1], self._eval(st[2], scope)
                if target[0] == "var":
                    if target[1] not in scope or target[1] in ("params", "ctx"):
                        raise ScriptError("illegal_argument_exception", f"cannot assign [{target[1]}]")
                    scope[target[1]] = value
                    continue
                container = self._eval(target[1], scope)
                key = target[2] if target[0] == "member" else self._eval(target[2], scope)
                if not isinstance(container, dict):
                    raise ScriptError("null_pointer_exception", f"cannot set [{key}] on {container!r}")
                container[key] = copy.deepcopy(value)

    @staticmethod
    def _bool(v: Any) -> bool:
        if not isinstance(v, bool):
            raise ScriptError("class_cast_exception", f"cannot cast {type(v).__name__} to boolean")
        return v

    @staticmethod
    def _num(v: Any) -> int | float:
        if v is None:
            raise ScriptError("null_pointer_exception", "cannot compare null")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ScriptError("class_cast_exception", f"cannot compare {type(v).__name__}")
        return v

    def _eval(self, e: Any, scope: dict[str, Any]) -> Any:
        op = e[0]
        if op == "const":
            return e[1]
        if op == "var":
            if e[1] not in scope:
                raise ValueError(f"painless: cannot resolve symbol [{e[1]}]")
            return scope[e[1]]
        if op in ("member", "index"):
            container = self._eval(e[1], scope)
            key = e[2] if op == "member" else self._eval(e[2], scope)
            if container is None:
                raise ScriptError("null_pointer_exception", f"cannot access [{key}] of null")
            if isinstance(container, dict):
                return container.get(key)
            if isinstance(container, list) and isinstance(key, int):
                return container[key]
            raise ScriptError("illegal_argument_exception", f"cannot access [{key}] of {type(container).__name__}")
        if op == "!":
            return not self._bool(self._eval(e[1], scope))
        if op == "||":
            return self._bool(self._eval(e[1], scope)) or self._bool(self._eval(e[2], scope))
        if op == "&&":
            return self._bool(self._eval(e[1], scope)) and self._bool(self._eval(e[2], scope))
        if op == "?:":
            return self._eval(e[2] if self._bool(self._eval(e[1], scope)) else e[3], scope)
        a, b = self._eval(e[1], scope), self._eval(e[2], scope)
        if op in ("==", "!="):
            num = isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool)
            equal = (a == b) if num or type(a) is type(b) or a is None or b is None else False
            return equal if op == "==" else not equal
        x, y = self._num(a), self._num(b)
        return {"<": x < y, ">": x > y, "<=": x <= y, ">=": x >= y}[op]


def _values(source: Mapping[str, Any], path: str) -> list[Any]:
    """The values of a (dotted) field in a source, arrays flattened."""
    current: list[Any] = [source]
    for part in path.split("."):
        nxt: list[Any] = []
        for c in current:
            if isinstance(c, Mapping) and part in c:
                v = c[part]
                nxt.extend(v if isinstance(v, list) else [v])
        current = nxt
    return [v for v in current if v is not None]


def field_type(mapping: Mapping[str, Any] | None, path: str) -> str | None:
    """The mapped type of a (dotted) field, None when unmapped or no mapping is given."""
    spec: Any = mapping
    for part in path.split("."):
        if not isinstance(spec, Mapping):
            return None
        spec = (spec.get("properties") or {}).get(part)
    return spec.get("type", "object") if isinstance(spec, Mapping) else None


def analyzed(value: Any) -> list[str]:
    """The terms the ``standard`` analyzer indexes for a ``text`` value: lowercased words, split
    at what is not a letter or digit (Unicode word boundaries, UAX #29; reference:
    analysis-standard-analyzer.md). A ``term`` query is not analyzed and matches only one of
    these (reference: query-dsl-term-query.md, "avoid using the term query for text fields")."""
    return re.findall(r"\w+", str(value).lower())


def _term_eq(v: Any, value: Any, kind: str | None) -> bool:
    if kind == "text":
        return isinstance(value, str) and value in analyzed(v)
    return v == value and type(v) is type(value) or _num_eq(v, value)


def matches(query: Mapping[str, Any], source: Mapping[str, Any], mapping: Mapping[str, Any] | None = None) -> bool:
    """Whether a document matches a query (the query DSL the sink sends), under the index's
    mapping (a ``text`` field is matched on its analyzed terms)."""
    ((kind, spec),) = query.items()
    if kind == "match_all":
        return True
    if kind == "bool":
        unknown = set(spec) - {"filter", "must", "should", "must_not", "minimum_should_match"}
        if unknown:
            raise _ApiFailure(400, "x_content_parse_exception", f"[bool] unknown field {sorted(unknown)}")

        def clauses(k: str) -> list[Mapping[str, Any]]:
            v = spec.get(k, [])
            return v if isinstance(v, list) else [v]

        if not all(matches(q, source, mapping) for q in clauses("filter") + clauses("must")):
            return False
        if any(matches(q, source, mapping) for q in clauses("must_not")):
            return False
        should = clauses("should")
        default = 0 if clauses("filter") or clauses("must") else 1
        minimum = int(spec.get("minimum_should_match", default if should else 0))
        return sum(matches(q, source, mapping) for q in should) >= minimum
    if kind == "term":
        ((name, value),) = spec.items()
        if isinstance(value, Mapping):
            value = value["value"]
        kind_of = field_type(mapping, name)
        return any(_term_eq(v, value, kind_of) for v in _values(source, name))
    if kind == "range":
        ((name, bounds),) = spec.items()
        ops: dict[str, Callable[[Any, Any], bool]] = {
            "gt": lambda a, b: a > b,
            "gte": lambda a, b: a >= b,
            "lt": lambda a, b: a < b,
            "lte": lambda a, b: a <= b,
        }
        if set(bounds) - set(ops):
            raise _ApiFailure(400, "parsing_exception", f"[range] unknown bound {sorted(set(bounds) - set(ops))}")
        return any(
            isinstance(v, int | float) and all(ops[k](v, b) for k, b in bounds.items()) for v in _values(source, name)
        )
    if kind == "terms":
        ((name, wanted),) = spec.items()
        kind_of = field_type(mapping, name)
        return any(_term_eq(v, w, kind_of) for v in _values(source, name) for w in wanted)
    if kind == "exists":
        return bool(_values(source, spec["field"]))
    raise _ApiFailure(400, "parsing_exception", f"unknown query [{kind}]")


_DATE = re.compile(r"\d{4}[-/]\d{2}[-/]\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?")


def dynamic_field(value: Any) -> dict[str, Any] | None:
    """The mapping ES 9's default dynamic mapping gives a new field from its first value: a
    string a ``date`` when it looks like one, else ``text`` with a ``keyword`` sub-field
    (``ignore_above`` 256), an integer a ``long``, a fraction a ``float``, an object an
    ``object`` (never ``nested``), an array its first value's; a null maps nothing."""
    if isinstance(value, list):
        return next((f for f in (dynamic_field(v) for v in value) if f is not None), None)
    if value is None:
        return None
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "long"}
    if isinstance(value, float):
        return {"type": "float"}
    if isinstance(value, Mapping):
        return {"type": "object", "properties": {}}
    if isinstance(value, str) and _DATE.fullmatch(value):
        return {"type": "date"}
    return {"type": "text", "fields": {"keyword": {"type": "keyword", "ignore_above": 256}}}


def lucene_clauses(query: Mapping[str, Any], mapping: Mapping[str, Any]) -> int:
    """The clauses Lucene's ``IndexSearcher`` counts in a query against ``maxClauseCount``: each
    leaf; a ``range`` on a numeric or date field is an ``IndexOrDocValuesQuery`` of two; a
    ``bool`` of ``must_not`` clauses only gains a ``MatchAllDocsQuery``; ``terms`` is one
    ``TermInSetQuery``."""
    ((kind, spec),) = query.items()
    if kind == "bool":
        groups = {k: spec.get(k, []) for k in ("filter", "must", "should", "must_not")}
        groups = {k: v if isinstance(v, list) else [v] for k, v in groups.items()}
        n = sum(lucene_clauses(q, mapping) for qs in groups.values() for q in qs)
        if groups["must_not"] and not (groups["filter"] or groups["must"] or groups["should"]):
            n += 1
        return n
    if kind == "range":
        ((name, _),) = spec.items()
        field = mapping.get("properties", {}).get(name, {})
        return 2 if field.get("type") in ("long", "integer", "float", "double", "date") else 1
    return 1


def _num_eq(a: Any, b: Any) -> bool:
    def num(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    return num(a) and num(b) and a == b


@dataclass
class _Doc:
    source: dict[str, Any]
    routing: str
    seq_no: int
    shard: int = 0


def shard_of(routing: str, shards: int) -> int:
    """The shard a routing value picks (reference: mapping-routing-field.md, ``shard_num =
    hash(_routing) % num_primary_shards``; Elasticsearch hashes with Murmur3, the fake with
    CRC-32: which shard is not what the sink relies on, only that a routing picks one)."""
    return zlib.crc32(routing.encode()) % shards


@dataclass
class _Index:
    mapping: dict[str, Any]
    live: dict[str, _Doc] = field(default_factory=dict)
    visible: dict[str, _Doc] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    """The index's settings as created (``index.number_of_shards``, ``index.lifecycle.name``...)."""
    shards: int = 1
    """``index.number_of_shards`` (1 by default since 7.0)."""
    write_block: bool = False
    """``index.blocks.write`` (reference: index-settings/index-block.md)."""
    flood_stage: bool = False
    """``index.blocks.read_only_allow_delete``, which the disk monitor puts on every index of a node
    over the flood-stage watermark (reference: troubleshoot/.../fix-watermark-errors.md;
    ``DiskThresholdMonitor``), and lifts once the disk is below the high watermark."""
    closed: bool = False
    """Closed by the close index API (reference: rest-apis/close-index; ``IndexClosedException``)."""
    primary_active: bool = True
    """False: its primaries are unassigned (a node lost): a write waits for them for its ``timeout``."""
    data_stream: str | None = None
    """The data stream it backs (``.ds-<name>-<date>-000001``)."""
    seqs: dict[int, int] = field(default_factory=dict)
    """Each shard's last sequence number, its first operation numbered 0 (reference:
    docs-replication, "sequence numbers"; ``LocalCheckpointTracker``, ``NO_OPS_PERFORMED`` -1)."""
    docs: dict[int, int] = field(default_factory=dict)
    """Each shard's Lucene documents, nested and deleted ones counted (an update deletes one)."""

    def next_seq(self, shard: int) -> int:
        self.seqs[shard] = self.seqs.get(shard, -1) + 1
        return self.seqs[shard]

    def refresh(self) -> None:
        self.visible = {k: _Doc(copy.deepcopy(d.source), d.routing, d.seq_no, d.shard) for k, d in self.live.items()}


def lucene_docs(mapping: Mapping[str, Any], source: Mapping[str, Any]) -> int:
    """The Lucene documents a document makes: itself and one per nested object (reference:
    mapping nested.md, "each nested object is indexed as a separate Lucene document")."""
    return 1 + sum(
        len(v) if isinstance(v, list) else 1
        for k, v in source.items()
        if field_type(mapping, k) == "nested" and v is not None
    )


@dataclass
class _DataStream:
    """A data stream (reference: data-streams.md): writes go to its write (last) backing index,
    ``create`` only, each document with an ``@timestamp``; custom routing only where its template
    allows it (``allow_custom_routing``)."""

    name: str
    indices: list[str]
    allow_custom_routing: bool = False


_PARAMS = {
    "bulk": {"refresh", "routing", "timeout", "pipeline", "wait_for_active_shards", "require_alias"},
    "search": {"routing", "preference", "timeout", "request_cache", "allow_partial_search_results"},
    "msearch": {"routing", "max_concurrent_searches", "search_type"},
    "update_by_query": {
        "routing",
        "refresh",
        "conflicts",
        "wait_for_completion",
        "slices",
        "scroll_size",
        "timeout",
        "requests_per_second",
        "max_docs",
        "wait_for_active_shards",
    },
    "mget": {"realtime", "refresh", "routing", "preference", "_source", "_source_includes", "_source_excludes"},
    "refresh": set(),
    "create": {"timeout", "master_timeout", "wait_for_active_shards"},
    "mapping": {"master_timeout", "local"},
    "put_template": {"create", "master_timeout", "cause"},
    "put_component": {"create", "master_timeout"},
    "health": {"wait_for_status", "wait_for_active_shards", "timeout", "level", "wait_for_nodes", "master_timeout"},
}
_INDEX_IMPLIES: dict[str, set[str]] = {
    # what an index privilege covers besides itself (reference: security-privileges.md)
    "all": {
        "create_doc",
        "create",
        "index",
        "write",
        "read",
        "maintenance",
        "manage",
        "view_index_metadata",
        "create_index",
        "monitor",
        "delete",
    },
    "manage": {"maintenance", "view_index_metadata", "create_index", "monitor"},
    "write": {"create_doc", "create", "index", "delete"},
    "index": {"create_doc", "create"},
    "create": {"create_doc"},
}
_CLUSTER_IMPLIES: dict[str, set[str]] = {
    "all": {"monitor", "manage", "manage_index_templates"},
    "manage": {"monitor", "manage_index_templates"},
}
_COMMON_PARAMS = {"filter_path", "error_trace", "human", "pretty"}
_SEARCH_BODY = {"query", "sort", "size", "from", "search_after", "_source", "track_total_hits"}
_UBQ_BODY = {"conflicts", "max_docs", "query", "script", "slice"}


@dataclass
class EsModel:
    """One Elasticsearch 9 node for the APIs the sink uses: indices of one or more shards, aliases
    and data streams, index and component templates, credentials and privileges, blocks."""

    indices: dict[str, _Index] = field(default_factory=dict)
    templates: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Composable index templates by name (``PUT _index_template/<name>``)."""
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Component templates by name (``PUT _component_template/<name>``)."""
    aliases: dict[str, dict[str, bool | None]] = field(default_factory=dict)
    """Aliases: name -> {index: is_write_index} (reference: aliases.md)."""
    data_streams: dict[str, _DataStream] = field(default_factory=dict)
    before_update: Callable[[EsModel, str, str], None] | None = None
    """Called with (model, index, id) as update_by_query is about to write a document: a test
    changes the document meanwhile (a concurrent stamp) to make a version conflict."""
    fail_update: Callable[[str], tuple[int, str, str] | None] | None = None
    """Given a document's id as update_by_query writes it: a failure (status, type, reason) of
    that document's write (a rejection, a mapping), or None."""
    requests: list[str] = field(default_factory=list)
    """``"<api> <index>"`` of each request answered (in order)."""
    auto_create_index: bool = True
    """``action.auto_create_index``: a bulk into a missing index creates it with a dynamic
    mapping (ES's default), else its items fail with 404 ``index_not_found_exception``."""

    credentials: set[str] | None = None
    """The ``Authorization`` values the node takes (:func:`api_key_header`, :func:`basic_header`);
    None: security off for authentication (every request anonymous and allowed)."""
    api_key_expired: bool = False
    """Every request is refused 401, as ES 9 refuses an expired API key (``ApiKeyService``: the
    authentication fails, ``AuthenticatorChain`` answers ``security_exception`` 401)."""
    index_privileges: set[str] | None = None
    """The index privileges of the caller on every index (None: a superuser). Each API checks
    the privileges that grant its action (reference: security-privileges.md, ``IndexPrivilege``)."""
    cluster_privileges: set[str] | None = None
    """The caller's cluster privileges (None: a superuser; ``ClusterPrivilegeResolver``)."""
    user: str = "wowd"
    heap_bytes: int = 1024 * 1024 * 1024
    """The node's heap: ``indexing_pressure.memory.limit`` is 10 % of it (reference:
    index-settings/pressure.md); a bulk over the limit is refused 429 (``IndexingPressure``)."""
    nested_objects_limit: int = 10_000
    """``index.mapping.nested_objects.limit`` (reference: index-settings/mapping-limit.md)."""
    max_docs_per_shard: int = LUCENE_MAX_DOCS
    """The Lucene documents a shard holds at most (a test lowers it)."""
    in_flight: int = 0
    """Bulks the node is working on now (one waits for a primary even after its client gave up)."""
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _changed: threading.Condition | None = None
    _released: bool = False

    version: str = "9.1.0"
    """The node's version (``GET /``); its major decides which compatible versions it accepts."""

    def _compatible(self, req: Recorded) -> None:
        """A ``compatible-with=N`` Accept or Content-Type must name this major or the one before
        (``RestCompatibleVersionHelper``: else 400 ``media_type_header_exception``, before any
        handler or authentication)."""
        major = int(self.version.split(".")[0])
        for header in ("accept", "content-type"):
            m = re.search(r"compatible-with=(\d+)", req.headers.get(header, ""))
            if m is not None and int(m.group(1)) not in (major, major - 1):
                cause = {
                    "type": "status_exception",
                    "reason": f"{header.title()} version must be either version {major} or {major - 1}, but found "
                    f"{m.group(1)}. {header.title()}={req.headers[header]}",
                }
                raise _ApiFailure(
                    400,
                    "media_type_header_exception",
                    "Invalid media-type value on headers [Accept, Content-Type]",
                    caused_by=cause,
                )

    def _info(self, req: Recorded) -> tuple[int, Any]:
        """``GET /`` (reference: rest-apis/info; cluster privilege ``monitor``)."""
        self.requests.append("info")
        self._authorize_cluster("cluster:monitor/main", "monitor", "manage", "all")
        return 200, {
            "name": "fake",
            "cluster_name": "fake",
            "cluster_uuid": "aBcD1234",
            "version": {
                "number": self.version,
                "build_flavor": "default",
                "build_type": "docker",
                "lucene_version": "10.2.2",
                "minimum_wire_compatibility_version": "8.19.0",
                "minimum_index_compatibility_version": "8.0.0",
            },
            "tagline": "You Know, for Search",
        }

    def answer(self, req: Recorded) -> tuple[int, Any]:
        with self._lock:
            return self._answer(req)

    def _answer(self, req: Recorded) -> tuple[int, Any]:
        parts = [p for p in req.path.split("/") if p]
        try:
            self._compatible(req)
        except _ApiFailure as exc:
            return exc.status, error(exc.status, exc.type, exc.reason, **exc.extra)
        refused = self._authenticate(req)
        if refused is not None:
            return 401, refused
        try:
            if not parts and req.method in ("GET", "HEAD"):
                return self._info(req)
            if parts == ["_security", "user", "_has_privileges"] and req.method in ("GET", "POST"):
                return self._has_privileges(req)
            if parts[:1] == ["_index_template"] and len(parts) == 2 and req.method in ("PUT", "POST"):
                return self._put_template(parts[1], req)
            if parts[:1] == ["_component_template"] and len(parts) == 2 and req.method in ("PUT", "POST"):
                return self._put_component(parts[1], req)
            if req.method == "GET" and parts[:2] == ["_cluster", "health"] and len(parts) == 3:
                return self._health(parts[2], req)
            if len(parts) == 1 and req.method == "PUT":
                return self._create(parts[0], req)
            if len(parts) == 2:
                name, api = parts
                routes: dict[tuple[str, str], Callable[[str, Recorded], tuple[int, Any]]] = {
                    ("PUT", "_bulk"): self._bulk,
                    ("POST", "_bulk"): self._bulk,
                    ("POST", "_search"): self._search_api,
                    ("GET", "_search"): self._search_api,
                    ("POST", "_msearch"): self._msearch,
                    ("POST", "_mget"): self._mget,
                    ("GET", "_mget"): self._mget,
                    ("POST", "_update_by_query"): self._ubq,
                    ("POST", "_refresh"): self._refresh,
                    ("GET", "_mapping"): self._get_mapping,
                }
                route = routes.get((req.method, api))
                if route is not None:
                    return route(name, req)
            raise _ApiFailure(400, "illegal_argument_exception", f"no handler for [{req.method} {req.path}]")
        except _ApiFailure as exc:
            return exc.status, error(exc.status, exc.type, exc.reason, **exc.extra)

    def _authenticate(self, req: Recorded) -> Raw | None:
        """The 401 of a request without credentials the node takes (``AuthenticationService``:
        "missing authentication credentials for REST request [path]" without any, else "unable
        to authenticate ..."), with the schemes in ``WWW-Authenticate``
        (``DefaultAuthenticationFailureHandler``); None when it may go on."""
        given = req.headers.get("authorization")
        if self.api_key_expired:
            reason = (
                "unable to authenticate with provided credentials and anonymous access is not allowed for this request"
            )
            body = error(
                401,
                "security_exception",
                reason,
                additional_unsuccessful_credentials="API key: api key [k1] has expired",
            )
        elif self.credentials is None or given in self.credentials:
            return None
        elif given is None:
            body = error(401, "security_exception", f"missing authentication credentials for REST request [{req.path}]")
        else:
            reason = (
                "unable to authenticate with provided credentials and anonymous access is not allowed for this request"
            )
            body = error(401, "security_exception", reason)
        challenge = (("WWW-Authenticate", 'Basic realm="security", charset="UTF-8"'), ("WWW-Authenticate", "ApiKey"))
        return Raw(json.dumps(body).encode(), "auto", headers=challenge)

    # ---- the cluster's state, for tests

    def primaries(self, name: str, active: bool) -> None:
        """The primaries of an index become unassigned (a node lost) or active again; a write
        waiting for them goes on then."""
        with self._lock:
            self.indices[name].primary_active = active
            self._condition().notify_all()

    def flood(self, name: str, on: bool = True) -> None:
        """The disk holding an index goes over the flood-stage watermark (or back below the high
        one): the block ``index.blocks.read_only_allow_delete`` is put on it (or lifted)."""
        with self._lock:
            self.indices[name].flood_stage = on

    def waiting(self, count: int, timeout_s: float) -> bool:
        """Waits (in a thread) until ``count`` requests wait on the cluster (a request the client
        gave up on may reach the node a moment after); False after ``timeout_s``."""
        with self._lock:
            return self._condition().wait_for(lambda: self.in_flight == count, timeout=timeout_s)

    def settled(self, timeout_s: float) -> bool:
        """Waits (in a thread) until no request waits on the cluster any more and the last one
        that did is answered; False after ``timeout_s``."""
        with self._lock:
            return self._condition().wait_for(lambda: self.in_flight == 0, timeout=timeout_s)

    def release(self) -> None:
        """Ends every wait (the server stops)."""
        with self._lock:
            self._released = True
            self._condition().notify_all()

    def _condition(self) -> threading.Condition:
        if self._changed is None:
            self._changed = threading.Condition(self._lock)
        return self._changed

    # ---- blocks, closed indices, privileges

    def block_writes(self, name: str, on: bool = True) -> None:
        """``PUT <index>/_settings {"index.blocks.write": on}``."""
        self.indices[name].write_block = on

    def close(self, name: str) -> None:
        self.indices[name].closed = True

    def open(self, name: str) -> None:
        self.indices[name].closed = False

    security_enabled: bool = True
    """``xpack.security.enabled``: off, a security API answers 500 (``SecurityActionFilter``)."""

    def _has_privileges(self, req: Recorded) -> tuple[int, Any]:
        """``_security/user/_has_privileges`` (reference: rest-apis/security-api-has-privileges):
        whether the caller holds each privilege asked, a privilege held through one that implies
        it (``all`` every one, ``manage`` the index administration ones, ``write`` ``index`` and
        ``create_doc``; reference: security-privileges.md)."""
        self.requests.append("has_privileges")
        if not self.security_enabled:
            reason = (
                "Security must be explicitly enabled when using a [basic] license. Enable security by setting "
                "[xpack.security.enabled] to [true] in the elasticsearch.yml file and restart the node."
            )
            return 500, error(500, "exception", reason)
        body = req.json() if req.body else {}
        if set(body) - {"cluster", "index", "application"}:
            raise _ApiFailure(400, "parsing_exception", f"unknown keys {sorted(body)}")

        def holds(held: set[str] | None, wanted: str, implied: Mapping[str, set[str]]) -> bool:
            return held is None or any(h == wanted or wanted in implied.get(h, set()) for h in held)

        cluster = {p: holds(self.cluster_privileges, p, _CLUSTER_IMPLIES) for p in body.get("cluster", [])}
        index: dict[str, dict[str, bool]] = {}
        for spec in body.get("index", []):
            for name in spec["names"]:
                index[name] = {p: holds(self.index_privileges, p, _INDEX_IMPLIES) for p in spec["privileges"]}
        every = all(cluster.values()) and all(v for held in index.values() for v in held.values())
        return 200, {
            "username": self.user,
            "has_all_requested": every,
            "cluster": cluster,
            "index": index,
            "application": {},
        }

    def _authorize(self, action: str, name: str, *granted_by: str) -> None:
        """403 unless the caller holds one of the index privileges ``granted_by`` (the message of
        ``AuthorizationService``'s denial)."""
        if self.index_privileges is None or self.index_privileges & set(granted_by):
            return
        raise _ApiFailure(403, "security_exception", self._denied(action, name, granted_by))

    def _authorize_cluster(self, action: str, *granted_by: str) -> None:
        if self.cluster_privileges is None or self.cluster_privileges & set(granted_by):
            return
        reason = (
            f"action [{action}] is unauthorized for user [{self.user}] with effective roles [{self.user}], "
            f"this action is granted by the cluster privileges [{','.join(granted_by)}]"
        )
        raise _ApiFailure(403, "security_exception", reason)

    def _denied(self, action: str, name: str, granted_by: tuple[str, ...]) -> str:
        return (
            f"action [{action}] is unauthorized for user [{self.user}] with effective roles [{self.user}] on indices "
            f"[{name}], this action is granted by the index privileges [{','.join(granted_by)}]"
        )

    def _open_index(self, name: str) -> _Index:
        """The index, which must be open: a closed one fails the request with 400
        ``index_closed_exception`` (``MetadataIndexStateService``/``IndexClosedException``)."""
        index = self._index(name)
        if index.closed:
            raise _ApiFailure(400, "index_closed_exception", "closed", index=name, index_uuid="aBcD1234")
        return index

    # ---- helpers

    def _log(self, api: str, index: str, req: Recorded) -> None:
        self.requests.append(f"{api} {index}")
        unknown = set(req.params) - _PARAMS[api] - _COMMON_PARAMS
        if unknown:
            raise _ApiFailure(
                400, "illegal_argument_exception", f"request [{req.path}] contains unrecognized parameters {unknown}"
            )

    def _index(self, name: str) -> _Index:
        if name not in self.indices:
            raise _ApiFailure(404, "index_not_found_exception", f"no such index [{name}]")
        return self.indices[name]

    @staticmethod
    def _flag(req: Recorded, name: str) -> bool:
        v = req.params.get(name)
        if v in (None, "false"):
            return False
        if v in ("", "true"):
            return True
        raise _ApiFailure(400, "illegal_argument_exception", f"Failed to parse value [{v}] for [{name}]")

    def _check_doc(self, index: _Index, doc: Any) -> None:
        mapping = index.mapping

        def obj(value: Any, props: Mapping[str, Any], dynamic: str, path: str) -> None:
            if not isinstance(value, Mapping):
                raise _ApiFailure(400, "document_parsing_exception", f"[{path}] expected an object")
            for k, v in value.items():
                spec = props.get(k)
                full = f"{path}.{k}" if path else k
                if spec is None:
                    if dynamic == "strict":
                        raise _ApiFailure(
                            400,
                            "strict_dynamic_mapping_exception",
                            f"[1:2] mapping set to strict, dynamic introduction of [{k}] within "
                            f"[{path or '_doc'}] is not allowed",
                        )
                    if dynamic != "true":
                        continue
                    spec = dynamic_field(v)
                    if spec is None:
                        continue
                    props[k] = spec  # type: ignore[index]
                val(v, spec, dynamic, full)

        def val(v: Any, spec: Mapping[str, Any], dynamic: str, path: str) -> None:
            if v is None:
                return
            if isinstance(v, list):
                for x in v:
                    val(x, spec, dynamic, path)
                return
            kind = spec.get("type", "object")
            if kind in ("object", "nested"):
                if spec.get("enabled") is False:
                    if not isinstance(v, Mapping):
                        raise _ApiFailure(400, "document_parsing_exception", f"[{path}] expected an object")
                    return
                obj(v, spec.setdefault("properties", {}), str(spec.get("dynamic", dynamic)).lower(), path)  # type: ignore[attr-defined]
                return
            if kind == "keyword" and isinstance(v, str):
                above = spec.get("ignore_above")
                if (above is None or len(v) <= int(above)) and len(v.encode()) > MAX_KEYWORD_BYTES:
                    # Lucene's IndexWriter refuses the term (an IllegalArgumentException, 400, not a
                    # parsing failure), caused by BytesRefHash's MaxBytesLengthExceededException
                    size = len(v.encode())
                    raise _ApiFailure(
                        400,
                        "illegal_argument_exception",
                        f'Document contains at least one immense term in field="{path}" (whose UTF8 encoding is '
                        f"longer than the max length {MAX_KEYWORD_BYTES}), all of which were skipped.  Please correct "
                        "the analyzer to not produce such terms.  The prefix of the first immense term is: "
                        f"'{list(v.encode()[:30])}...', original message: bytes can be at most {MAX_KEYWORD_BYTES} in "
                        f"length; got {size}",
                        caused_by={
                            "type": "max_bytes_length_exceeded_exception",
                            "reason": f"bytes can be at most {MAX_KEYWORD_BYTES} in length; got {size}",
                        },
                    )
            ok = {
                "keyword": isinstance(v, str | int | float) and not isinstance(v, Mapping),
                "text": isinstance(v, str | int | float) and not isinstance(v, Mapping),
                "float": isinstance(v, int | float) and not isinstance(v, bool),
                "long": isinstance(v, int) and not isinstance(v, bool),
                "date": isinstance(v, int | str) and not isinstance(v, bool),
                "boolean": isinstance(v, bool),
            }.get(kind)
            if ok is None:
                raise _ApiFailure(400, "mapper_parsing_exception", f"fake: no support for type [{kind}]")
            if not ok:
                raise _ApiFailure(400, "document_parsing_exception", f"failed to parse field [{path}] of type [{kind}]")

        obj(doc, mapping.setdefault("properties", {}), str(mapping.get("dynamic", "true")).lower(), "")
        nested = sum(
            len(v) if isinstance(v, list) else 1
            for k, v in doc.items()
            if field_type(mapping, k) == "nested" and v is not None
        )
        if nested > self.nested_objects_limit:
            # DocumentParserContext.addDoc (DocumentParsingException, 400)
            raise _ApiFailure(
                400,
                "document_parsing_exception",
                f"[1:2] The number of nested documents has exceeded the allowed limit of [{self.nested_objects_limit}]."
                " This limit can be set by changing the [index.mapping.nested_objects.limit] index level setting.",
            )

    # ---- APIs

    def _health(self, name: str, req: Recorded) -> tuple[int, Any]:
        self._log("health", name, req)
        self._authorize_cluster("cluster:monitor/health", "monitor", "manage", "all")
        targets = self._targets(name, missing_ok=True)
        if not targets or not all(self.indices[t].primary_active for t in targets):
            body = health(name, "red", timed_out=True)
            return (408 if "wait_for_status" in req.params else 200), body
        return 200, health(name, "yellow")

    def _targets(self, name: str, *, missing_ok: bool = False) -> list[str]:
        """The indices a name stands for: an index, an alias's indices, a data stream's backing
        indices (reference: aliases.md, data-streams.md); 404 when none and not ``missing_ok``."""
        if name in self.indices:
            return [name]
        if name in self.aliases:
            return sorted(self.aliases[name])
        if name in self.data_streams:
            return list(self.data_streams[name].indices)
        if missing_ok:
            return []
        raise _ApiFailure(404, "index_not_found_exception", f"no such index [{name}]", **{"resource.id": name})

    def _create(self, name: str, req: Recorded) -> tuple[int, Any]:
        self._log("create", name, req)
        self._authorize("indices:admin/create", name, "create_index", "manage", "all")
        body = req.json() if req.body else {}
        if set(body) - {"mappings", "settings", "aliases"}:
            raise _ApiFailure(400, "parse_exception", f"unknown key(s) {sorted(set(body))} for create index")
        if name in self.indices or name in self.data_streams:
            raise _ApiFailure(400, "resource_already_exists_exception", f"index [{name}/xyz] already exists")
        if name in self.aliases:  # MetadataCreateIndexService.validateIndexName
            raise _ApiFailure(
                400, "invalid_index_name_exception", f"Invalid index name [{name}], already exists as alias"
            )
        template_name, template = self._template_for(name)
        if template is not None and "data_stream" in template:
            # MetadataCreateIndexService.validateIndexName (IllegalArgumentException, 400)
            reason = (
                f"cannot create index with name [{name}], because it matches with template [{template_name}] that "
                "creates data streams only, use create data stream api instead"
            )
            raise _ApiFailure(400, "illegal_argument_exception", reason)
        mapping, settings = self._composed(template)
        asked = body.get("mappings", {})
        mapping = {**mapping, **asked, "properties": {**mapping.get("properties", {}), **asked.get("properties", {})}}
        settings = {**settings, **_flat(body.get("settings", {}))}
        if str(mapping.get("dynamic", "true")).lower() not in ("true", "false", "strict", "runtime"):
            raise _ApiFailure(400, "mapper_parsing_exception", "bad dynamic")
        self.indices[name] = self._new_index(mapping, settings)
        return 200, created(name)

    @staticmethod
    def _new_index(mapping: dict[str, Any], settings: dict[str, Any]) -> _Index:
        return _Index(mapping=mapping, settings=settings, shards=int(settings.get("index.number_of_shards", 1)))

    def _template_for(self, name: str) -> tuple[str | None, dict[str, Any] | None]:
        """The index template with the highest priority whose patterns match the name, which a
        new index (or data stream) gets, made by the create index API or by a write (reference:
        index-templates.md, "the index template with the highest priority is used";
        ``MetadataIndexTemplateService.findV2Template``)."""
        found = [
            (n, t)
            for n, t in self.templates.items()
            if any(fnmatch.fnmatchcase(name, p) for p in t.get("index_patterns", []))
        ]
        if not found:
            return None, None
        return max(found, key=lambda nt: int(nt[1].get("priority", 0)))

    def _composed(self, template: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """The mappings and settings a template gives: its component templates merged in the
        order of ``composed_of`` (a later one over an earlier one), then its own over them
        (reference: index-templates.md; a missing one listed in
        ``ignore_missing_component_templates`` is skipped)."""
        mapping: dict[str, Any] = {}
        settings: dict[str, Any] = {}
        if template is None:
            return mapping, settings
        parts = [self.components[c]["template"] for c in template.get("composed_of", []) if c in self.components]
        for part in [*parts, template.get("template", {})]:
            m = copy.deepcopy(part.get("mappings", {}))
            mapping = {**mapping, **m, "properties": {**mapping.get("properties", {}), **m.get("properties", {})}}
            settings.update(_flat(part.get("settings", {})))
        return mapping, settings

    def _put_template(self, name: str, req: Recorded) -> tuple[int, Any]:
        """``PUT _index_template/<name>`` (reference: rest-apis/put-index-template): replaces a
        template of that name; another template matching the same names at the same priority is
        refused (``MetadataIndexTemplateService.validateV2TemplateRequest``, 400), and so is a
        component template named in ``composed_of`` that does not exist, unless it is listed in
        ``ignore_missing_component_templates`` (``InvalidIndexTemplateException``, 400)."""
        self._log("put_template", name, req)
        self._authorize_cluster("indices:admin/index_template/put", "manage_index_templates", "manage", "all")
        body = req.json() if req.body else {}
        allowed = {
            "index_patterns",
            "template",
            "priority",
            "composed_of",
            "version",
            "_meta",
            "data_stream",
            "allow_auto_create",
            "ignore_missing_component_templates",
            "deprecated",
        }
        if set(body) - allowed:
            raise _ApiFailure(400, "x_content_parse_exception", f"unknown field(s) {sorted(set(body) - allowed)}")
        if set(body.get("template", {})) - {"mappings", "settings", "aliases", "lifecycle"}:
            raise _ApiFailure(400, "x_content_parse_exception", "unknown field in [template]")
        ignored = set(body.get("ignore_missing_component_templates", []))
        missing = [c for c in body.get("composed_of", []) if c not in self.components and c not in ignored]
        if missing:
            reason = f"index template [{name}] specifies component templates {missing} that do not exist"
            raise _ApiFailure(
                400, "invalid_index_template_exception", f"index_template [{name}] invalid, cause [{reason}]"
            )
        patterns = body.get("index_patterns") or []
        for other_name, other in self.templates.items():
            if other_name == name or int(other.get("priority", 0)) != int(body.get("priority", 0)):
                continue
            theirs = other.get("index_patterns", [])
            if any(fnmatch.fnmatchcase(a, b) or fnmatch.fnmatchcase(b, a) for a in patterns for b in theirs):
                reason = (
                    f"index template [{name}] has index patterns {patterns} matching patterns from existing "
                    f"templates [{other_name}] with patterns ({other_name} => {theirs}) that have the same priority "
                    f"[{body.get('priority', 0)}]"
                )
                raise _ApiFailure(400, "illegal_argument_exception", reason)
        self.templates[name] = copy.deepcopy(body)
        return 200, {"acknowledged": True}

    def _put_component(self, name: str, req: Recorded) -> tuple[int, Any]:
        """``PUT _component_template/<name>`` (reference: rest-apis/put-component-template)."""
        self._log("put_component", name, req)
        self._authorize_cluster("cluster:admin/component_template/put", "manage_index_templates", "manage", "all")
        body = req.json() if req.body else {}
        if set(body) - {"template", "version", "_meta", "deprecated"}:
            raise _ApiFailure(400, "x_content_parse_exception", f"unknown field(s) {sorted(body)}")
        self.components[name] = copy.deepcopy(body)
        return 200, {"acknowledged": True}

    def _get_mapping(self, name: str, req: Recorded) -> tuple[int, Any]:
        """Each index the name stands for, by its own name (reference: indices-get-mapping)."""
        self._log("mapping", name, req)
        self._authorize("indices:admin/mappings/get", name, "view_index_metadata", "manage", "all")
        return 200, {t: {"mappings": stored_mapping(self.indices[t].mapping)} for t in self._targets(name)}

    def _refresh(self, name: str, req: Recorded) -> tuple[int, Any]:
        self._log("refresh", name, req)
        self._authorize("indices:admin/refresh", name, "maintenance", "manage", "all")
        for t in self._targets(name):
            self._open_index(t).refresh()
        return 200, refreshed()

    def _write_index(self, name: str) -> tuple[str | None, str | None]:
        """Where a write to ``name`` goes: (index, None), or (None, why not: an alias without a
        write index, ``IndexAbstraction.getWriteIndex``; IllegalArgumentException, 400), or
        (None, None) when it names nothing."""
        if name in self.indices:
            return name, None
        if name in self.data_streams:
            return self.data_streams[name].indices[-1], None
        if name in self.aliases:
            targets = self.aliases[name]
            flagged = [t for t, w in targets.items() if w]
            if flagged:
                return flagged[0], None
            if len(targets) == 1 and next(iter(targets.values())) is not False:
                return next(iter(targets)), None
            reason = (
                f"no write index is defined for alias [{name}]. The write index may be explicitly disabled using "
                "is_write_index=false or the alias points to multiple indices without one being designated as a "
                "write index"
            )
            return None, reason
        return None, None

    def _auto_create(self, name: str) -> None:
        """A write to a missing name: a data stream where the matching template makes them, else
        an index with the template's mapping and settings, else a dynamic one (ES's defaults)."""
        self.requests.append(f"auto_create {name}")
        _template_name, template = self._template_for(name)
        mapping, settings = self._composed(template)
        if template is not None and "data_stream" in template:
            backing = f".ds-{name}-2026.01.01-000001"
            mapping.setdefault("properties", {})["@timestamp"] = {"type": "date"}
            mapping["_data_stream_timestamp"] = {"enabled": True}
            self.indices[backing] = self._new_index(mapping, settings)
            self.indices[backing].data_stream = name
            allow = bool(template["data_stream"].get("allow_custom_routing", False))
            self.data_streams[name] = _DataStream(name, [backing], allow_custom_routing=allow)
            return
        self.indices[name] = self._new_index(mapping, settings)

    def _wait_for_primaries(self, index: _Index, timeout_s: float) -> bool:
        """Waits (the model's lock let go) up to the bulk's ``timeout`` for the index's primaries
        (``TransportReplicationAction.ReroutePhase``: it retries on each cluster state change
        until the request's timeout); True once they are active."""
        changed = self._condition()
        self.in_flight += 1
        changed.notify_all()  # seen by waiting()
        try:
            changed.wait_for(lambda: index.primary_active or self._released, timeout=timeout_s)
        finally:
            self.in_flight -= 1
            changed.notify_all()  # seen by settled() once this request's answer is done (the lock)
        return index.primary_active

    def _bulk(self, name: str, req: Recorded) -> tuple[int, Any]:
        self._log("bulk", name, req)
        limit = self.heap_bytes // 10
        if len(req.body) > limit:
            # IndexingPressure.markCoordinatingOperationStarted: the whole request is refused
            reason = (
                f"rejected execution of coordinating operation [coordinating_and_primary_bytes=0, replica_bytes=0, "
                f"all_bytes=0, coordinating_operation_bytes={len(req.body)}, "
                f"max_coordinating_and_primary_bytes={limit}]"
            )
            raise _ApiFailure(429, "es_rejected_execution_exception", reason)
        lines = req.ndjson()
        pairs = list(zip(lines[0::2], lines[1::2], strict=True))
        # the whole request is validated before any item runs (BulkRequest.validate)
        problems = []
        for action_line, _ in pairs:
            ((action, meta),) = action_line.items()
            if action != "create" or set(meta) - {"_id", "routing", "_index"}:
                raise _ApiFailure(400, "illegal_argument_exception", f"fake: unexpected action {action_line}")
            _id = meta.get("_id")
            if isinstance(_id, str) and len(_id.encode()) > 512:
                size = len(_id.encode())
                problems.append(f"id [{_id}] is too long, must be no longer than 512 bytes but was: {size}")
        if problems:
            reason = "Validation Failed: " + "".join(f"{n}: {p};" for n, p in enumerate(problems, 1))
            raise _ApiFailure(400, "action_request_validation_exception", reason)
        timeout_s = _duration_s(req.params.get("timeout", "1m"))
        target, no_write_index = self._write_index(name)
        if target is None and no_write_index is None:
            if not self.auto_create_index:
                items = [
                    {
                        "create": {
                            "_index": name,
                            "_id": a["create"].get("_id"),
                            "status": 404,
                            "error": {"type": "index_not_found_exception", "reason": f"no such index [{name}]"},
                        }
                    }
                    for a, _ in pairs
                ]
                return 200, {"errors": True, "took": 1, "items": items}
            self._auto_create(name)
            target, no_write_index = self._write_index(name)
        stream = self.data_streams.get(name)
        index = self.indices[target] if target is not None else None
        if index is not None and not index.primary_active and not self._wait_for_primaries(index, timeout_s):
            # UnavailableShardsException (503), each item of the shard's bulk
            reason = (
                f"[{target}][0] primary shard is not active Timeout: [{req.params.get('timeout', '1m')}], request: "
                f"[BulkShardRequest [[{target}][0]] containing [{len(pairs)}] requests]"
            )
            items = [
                {"create": {"_index": target, "_id": a["create"].get("_id"), "status": 503,
                            "error": {"type": "unavailable_shards_exception", "reason": reason}}}
                for a, _ in pairs
            ]  # fmt: skip
            return 200, {"errors": True, "took": int(timeout_s * 1000), "items": items}
        items = []
        for action_line, doc in pairs:
            meta = action_line["create"]
            _id = meta.get("_id")
            item: dict[str, Any] = {"_index": target or name, "_id": _id}
            try:
                self._create_doc(name, index, stream, no_write_index, meta, doc)
                assert index is not None
                d = index.live[_id]
                item.update(status=201, result="created", _version=1, _seq_no=d.seq_no, _primary_term=1)
            except _ApiFailure as exc:
                err = {"type": exc.type, "reason": exc.reason}
                if "caused_by" in exc.extra:
                    err["caused_by"] = exc.extra["caused_by"]
                item.update(status=exc.status, error=err)
            items.append({"create": item})
        if index is not None and self._flag(req, "refresh"):
            index.refresh()
        return 200, {"errors": any(it["create"]["status"] >= 300 for it in items), "took": 1, "items": items}

    def _create_doc(
        self,
        name: str,
        index: _Index | None,
        stream: _DataStream | None,
        no_write_index: str | None,
        meta: Mapping[str, Any],
        doc: Any,
    ) -> None:
        """One ``create`` of a bulk, its checks in the order Elasticsearch makes them: the write
        index of an alias (``TransportBulkAction``), a data stream's custom routing
        (``TransportBulkAction.prohibitCustomRoutingOnDataStream``), the privilege
        (``AuthorizationService`` authorizes each item), a closed index (``BulkOperation``), the
        blocks (``TransportReplicationAction``: the write block 403, the flood-stage block 429,
        ``ClusterBlockException.status``), routing, the mapping (``DocumentParser``), the shard's
        document limit (``InternalEngine.tryAcquireInFlightDocs``: IllegalArgumentException,
        400), the id (409)."""
        _id = meta.get("_id")
        if no_write_index is not None:
            raise _ApiFailure(400, "illegal_argument_exception", no_write_index)
        assert index is not None
        target = next(n for n, i in self.indices.items() if i is index)
        routing = meta.get("routing") or None  # an empty routing is none
        if stream is not None and routing is not None and not stream.allow_custom_routing:
            reason = (
                f"index request targeting data stream [{stream.name}] specifies a custom routing but the "
                "[allow_custom_routing] setting was not enabled in the data stream's template."
            )
            raise _ApiFailure(400, "illegal_argument_exception", reason)
        granted = ("create_doc", "create", "index", "write", "all")
        if self.index_privileges is not None and not self.index_privileges & set(granted):
            raise _ApiFailure(403, "security_exception", self._denied("indices:data/write/bulk[s]", name, granted))
        if index.closed:
            raise _ApiFailure(400, "index_closed_exception", "closed")
        if index.write_block:
            reason = f"index [{target}] blocked by: [FORBIDDEN/8/index write (api)];"
            raise _ApiFailure(403, "cluster_block_exception", reason)
        if index.flood_stage:
            reason = (
                f"index [{target}] blocked by: [TOO_MANY_REQUESTS/12/disk usage exceeded flood-stage watermark, "
                "index has read-only-allow-delete block];"
            )
            raise _ApiFailure(429, "cluster_block_exception", reason)
        if index.mapping.get("_routing", {}).get("required") and routing is None:
            raise _ApiFailure(400, "routing_missing_exception", f"routing is required for [{target}]/[{_id}]")
        self._check_doc(index, doc)
        if index.data_stream is not None and not isinstance(doc.get("@timestamp"), str | int):
            # DataStreamTimestampFieldMapper: a DocumentParsingException caused by an IllegalArgumentException
            cause = {
                "type": "illegal_argument_exception",
                "reason": "data stream timestamp field [@timestamp] is missing",
            }
            reason = "[1:2] failed to parse: data stream timestamp field [@timestamp] is missing"
            raise _ApiFailure(400, "document_parsing_exception", reason, caused_by=cause)
        shard = shard_of(routing or _id, index.shards)
        count = lucene_docs(index.mapping, doc)
        if index.docs.get(shard, 0) + count > self.max_docs_per_shard:
            reason = f"Number of documents in the shard cannot exceed [{self.max_docs_per_shard}]"
            raise _ApiFailure(400, "illegal_argument_exception", reason)
        if _id in index.live:
            raise _ApiFailure(
                409,
                "version_conflict_engine_exception",
                f"[{_id}]: version conflict, document already exists (current version [1])",
            )
        index.docs[shard] = index.docs.get(shard, 0) + count
        index.live[_id] = _Doc(copy.deepcopy(doc), routing or _id, index.next_seq(shard), shard)

    def _mget(self, name: str, req: Recorded) -> tuple[int, Any]:
        """Realtime by default: a document is read as written, refreshed or not."""
        self._log("mget", name, req)
        self._authorize("indices:data/read/mget", name, "read", "all")
        body = req.json() if req.body else {}
        if set(body) - {"docs", "ids"}:
            raise _ApiFailure(400, "parsing_exception", f"Unknown key(s) {sorted(body)} for mget")
        docs = []
        for spec in body.get("docs", []):
            if set(spec) - {"_id", "_index", "routing", "_source"}:
                raise _ApiFailure(400, "parsing_exception", f"Unknown key(s) {sorted(spec)} in a doc")
            target = spec.get("_index", name)
            _id = spec["_id"]
            targets = self._targets(target, missing_ok=True)
            if len(targets) > 1:  # an alias of several indices, a data stream: a get needs one index
                reason = f"alias [{target}] has more than one index associated with it, can't execute a single index op"
                docs.append(
                    {"_index": target, "_id": _id, "error": {"type": "illegal_argument_exception", "reason": reason}}
                )
                continue
            target = targets[0] if targets else target
            if target not in self.indices:
                err = {"type": "index_not_found_exception", "reason": f"no such index [{target}]"}
                docs.append({"_index": target, "_id": _id, "error": err})
                continue
            index = self.indices[target]
            if index.closed:
                docs.append(
                    {"_index": target, "_id": _id, "error": {"type": "index_closed_exception", "reason": "closed"}}
                )
                continue
            if index.mapping.get("_routing", {}).get("required") and not spec.get("routing"):
                err = {"type": "routing_missing_exception", "reason": f"routing is required for [{target}]/[{_id}]"}
                docs.append({"_index": target, "_id": _id, "error": err})
                continue
            realtime = req.params.get("realtime") in (None, "", "true")
            d = (index.live if realtime else index.visible).get(_id)
            if d is None:
                docs.append({"_index": target, "_id": _id, "found": False})
                continue
            includes = spec.get("_source")
            source = d.source if includes is None else {f: d.source[f] for f in includes if f in d.source}
            docs.append(
                {
                    "_index": target,
                    "_id": _id,
                    "_version": 1,
                    "_seq_no": d.seq_no,
                    "_primary_term": 1,
                    "_routing": d.routing,
                    "found": True,
                    "_source": copy.deepcopy(source),
                }
            )
        return 200, {"docs": docs}

    @staticmethod
    def _check_clauses(index: _Index, query: Mapping[str, Any]) -> None:
        n = lucene_clauses(query, index.mapping)
        if n > MAX_CLAUSE_COUNT:
            reason = f"Query contains too many nested clauses; maxClauseCount is set to {MAX_CLAUSE_COUNT}"
            cause = {"type": "too_many_nested_clauses", "reason": reason}
            raise _ApiFailure(400, "search_phase_execution_exception", "all shards failed", caused_by=cause)

    def _select(self, index: _Index, query: Mapping[str, Any], routing: str | None) -> list[tuple[str, _Doc]]:
        self._check_clauses(index, query)
        routes = None if routing is None else set(routing.split(","))
        return [
            (k, d)
            for k, d in index.visible.items()
            if (routes is None or d.routing in routes) and matches(query, d.source, index.mapping)
        ]

    def _search(self, name: str, body: Mapping[str, Any], routing: str | None) -> dict[str, Any]:
        if set(body) - _SEARCH_BODY:
            raise _ApiFailure(400, "parsing_exception", f"Unknown key(s) {sorted(set(body) - _SEARCH_BODY)}")
        self._authorize("indices:data/read/search", name, "read", "all")
        query = body.get("query", {"match_all": {}})
        found = [kd for t in self._targets(name) for kd in self._select(self._open_index(t), query, routing)]
        sort = body.get("sort", [])
        keys: list[tuple[str, bool]] = []
        for s in sort:
            ((f, spec),) = s.items()
            keys.append((f, spec.get("order", "asc") == "desc"))
        for f, desc in reversed(keys):

            def key(kd: tuple[str, _Doc], f: str = f) -> Any:
                return _values(kd[1].source, f)[0]

            found.sort(key=key, reverse=desc)
        after = body.get("search_after")
        if after is not None:
            (f, desc), (a,) = keys[0], after
            found = [(k, d) for k, d in found if (_values(d.source, f)[0] < a if desc else _values(d.source, f)[0] > a)]
        size = int(body.get("size", 10))
        includes = body.get("_source")
        hits_ = []
        for k, d in found[:size]:
            src = d.source if includes is None else {f: d.source[f] for f in includes if f in d.source}
            hit: dict[str, Any] = {"_index": name, "_id": k, "_score": None, "_routing": d.routing, "_source": src}
            if keys:
                hit["sort"] = [_values(d.source, f)[0] for f, _ in keys]
            hits_.append(hit)
        return {
            "took": 1,
            "timed_out": False,
            "_shards": {"total": 1, "successful": 1, "skipped": 0, "failed": 0},
            "hits": {"total": {"value": len(found), "relation": "eq"}, "max_score": None, "hits": hits_},
        }

    def _search_api(self, name: str, req: Recorded) -> tuple[int, Any]:
        self._log("search", name, req)
        return 200, self._search(name, req.json() if req.body else {}, req.params.get("routing"))

    def _msearch(self, name: str, req: Recorded) -> tuple[int, Any]:
        self._log("msearch", name, req)
        lines = req.ndjson()
        responses = []
        for header, body in zip(lines[0::2], lines[1::2], strict=True):
            if set(header) - {"index", "routing", "preference", "allow_partial_search_results"}:
                raise _ApiFailure(400, "illegal_argument_exception", f"key [{sorted(header)}] is not supported")
            try:
                found = self._search(header.get("index", name), body, header.get("routing"))
                responses.append({**found, "status": 200})
            except _ApiFailure as exc:
                responses.append(error(exc.status, exc.type, exc.reason))
        return 200, {"took": 1, "responses": responses}

    def _ubq(self, name: str, req: Recorded) -> tuple[int, Any]:
        """``_update_by_query`` (reference: docs-update-by-query): the documents the query finds
        in the last refresh, updated in batches of ``scroll_size`` (1,000); a document changed
        since the search is a version conflict; a batch whose bulk had a failure ends the request
        (``AbstractAsyncBulkByScrollAction.onBulkResponse``: "if there are failures, finish"),
        and what it updated stays."""
        self._log("update_by_query", name, req)
        body = req.json() if req.body else {}
        if set(body) - _UBQ_BODY:
            raise _ApiFailure(400, "parsing_exception", f"Unknown key(s) {sorted(set(body) - _UBQ_BODY)}")
        conflicts = body.get("conflicts", req.params.get("conflicts", "abort"))
        if conflicts not in ("abort", "proceed"):
            raise _ApiFailure(400, "illegal_argument_exception", f"conflicts may only be abort or proceed: {conflicts}")
        self._authorize("indices:data/read/search", name, "read", "all")
        self._authorize("indices:data/write/update/byquery", name, "index", "write", "all")
        script = body.get("script") or {}
        if script.get("lang", "painless") != "painless" or not isinstance(script.get("source"), str):
            raise _ApiFailure(400, "illegal_argument_exception", "fake: a painless source script is expected")
        try:
            program = Painless(script["source"])
        except ValueError as exc:
            raise _ApiFailure(400, "script_exception", f"compile error: {exc}") from exc
        params = script.get("params", {})
        batch = int(req.params.get("scroll_size", 1000))
        answer = ubq_answer()
        found = [
            (t, _id, seen)
            for t in self._targets(name)
            for _id, seen in self._select(
                self._open_index(t), body.get("query", {"match_all": {}}), req.params.get("routing")
            )
        ]
        for start in range(0, len(found), batch):
            answer["batches"] = start // batch + 1
            for target, _id, seen in found[start : start + batch]:
                index = self.indices[target]
                if self.before_update is not None:
                    self.before_update(self, target, _id)
                ctx: dict[str, Any] = {"_source": copy.deepcopy(seen.source), "op": "index", "_id": _id}
                try:
                    program.run(copy.deepcopy(params), ctx)
                except ScriptError as exc:
                    err = script_error("runtime error", exc.type, exc.reason)
                    return 400, err
                answer["total"] += 1
                if ctx["op"] == "noop":
                    answer["noops"] += 1
                    continue
                if ctx["op"] != "index":
                    raise _ApiFailure(400, "illegal_argument_exception", f"fake: op [{ctx['op']}] not supported")
                live = index.live[_id]
                if live.seq_no != seen.seq_no:  # changed since the search read it
                    answer["version_conflicts"] += 1
                    if conflicts == "abort":
                        answer["failures"].append(
                            bulk_failure(
                                target, _id, 409, "version_conflict_engine_exception", f"[{_id}]: version conflict"
                            )
                        )
                    continue
                try:
                    self._update_doc(target, index, _id, ctx["_source"])
                except _ApiFailure as exc:
                    answer["failures"].append(bulk_failure(target, _id, exc.status, exc.type, exc.reason))
                    continue
                index.live[_id] = _Doc(ctx["_source"], live.routing, index.next_seq(live.shard), live.shard)
                index.docs[live.shard] = index.docs.get(live.shard, 0) + lucene_docs(index.mapping, ctx["_source"])
                answer["updated"] += 1
            if answer["failures"]:
                break
        if self._flag(req, "refresh"):
            for t in self._targets(name):
                self.indices[t].refresh()
        return ubq_status(answer), answer

    def _update_doc(self, target: str, index: _Index, _id: str, source: Any) -> None:
        """One update of an ``_update_by_query``'s bulk: the blocks (see :meth:`_create_doc`),
        a failure a test puts on the document (:attr:`fail_update`), the mapping."""
        if index.write_block:
            raise _ApiFailure(
                403, "cluster_block_exception", f"index [{target}] blocked by: [FORBIDDEN/8/index write (api)];"
            )
        if index.flood_stage:
            reason = (
                f"index [{target}] blocked by: [TOO_MANY_REQUESTS/12/disk usage exceeded flood-stage watermark, "
                "index has read-only-allow-delete block];"
            )
            raise _ApiFailure(429, "cluster_block_exception", reason)
        failure = self.fail_update(_id) if self.fail_update is not None else None
        if failure is not None:
            raise _ApiFailure(*failure)
        self._check_doc(index, source)

    # ---- for tests

    def stamp_now(self, index: str, _id: str, access: Mapping[str, Any], as_of: int, digest: str) -> None:
        """Changes a document's access attributes (another stamp writing it meanwhile)."""
        live = self.indices[index].live[_id]
        source = copy.deepcopy(live.source)
        source.update(
            access=dict(access),
            owner_id=access.get("owner_id", ""),
            space_id=access.get("space_id", ""),
            access_version=as_of,
            access_digest=digest,
        )
        self.indices[index].live[_id] = _Doc(source, live.routing, self.indices[index].next_seq(live.shard), live.shard)


def _flat(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Settings as Elasticsearch normalizes them: nested objects flattened to dotted keys, each
    under ``index.`` (``{"number_of_shards": 2}`` is ``index.number_of_shards``)."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{key}."))
        else:
            out[key if key.startswith("index.") else f"index.{key}"] = v
    return out


_UNITS = {"nanos": 1e-9, "micros": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration_s(text: str) -> float:
    """A time value as Elasticsearch reads one (reference: api-conventions, "time units")."""
    m = re.fullmatch(r"(\d+)(nanos|micros|ms|s|m|h|d)", text)
    if m is None:
        raise _ApiFailure(400, "illegal_argument_exception", f"failed to parse setting [timeout] with value [{text}]")
    return int(m.group(1)) * _UNITS[m.group(2)]


@contextmanager
def serving(tls: ssl.SSLContext | None = None) -> Iterator[FakeElasticsearch]:
    """A started fake (over TLS with ``tls``); on a clean exit it asserts that nothing
    unscripted came and every scripted answer was used (the tests' fixture)."""
    server = FakeElasticsearch(tls=tls)
    server.start()
    try:
        yield server
        assert not server.unexpected, [f"{r.method} {r.path}" for r in server.unexpected]
        assert not server.pending(), server.pending()
    finally:
        server.stop()
