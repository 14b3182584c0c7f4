"""A local HTTP server that answers as Elasticsearch 9 does, scripted per test.

It runs in a thread (``http.server``) on ``127.0.0.1:0``; the real ``AsyncElasticsearch``
client talks to it over a socket. Every answer carries ``X-Elastic-Product: Elasticsearch``
(the client refuses a server without it) and the content type ES 9 answers to the client's
``compatible-with=9`` accept header.

A test queues answers (``fake.on(method, path, status, body)``: FIFO, each used once; ``body``
may be a function of the request), calls the store, then reads ``fake.requests``. A request with
no answer queued is answered 400 and kept in ``fake.unexpected`` (the fixture asserts it empty).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

CONTENT_TYPE = "application/vnd.elasticsearch+json;compatible-with=9"


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
        return [json.loads(line) for line in self.body.decode().splitlines() if line.strip()]


Body = Any | Callable[[Recorded], Any]


@dataclass
class _Answer:
    method: str
    path: re.Pattern[str]
    status: int
    body: Body


@dataclass
class FakeElasticsearch:
    requests: list[Recorded] = field(default_factory=list)
    unexpected: list[Recorded] = field(default_factory=list)
    _answers: list[_Answer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

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

    def _answer(self, req: Recorded) -> tuple[int, Any]:
        with self._lock:
            self.requests.append(req)
            for i, a in enumerate(self._answers):
                if a.method == req.method and a.path.fullmatch(req.path):
                    del self._answers[i]
                    body = a.body(req) if callable(a.body) else a.body
                    return a.status, body
            self.unexpected.append(req)
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
                status, body = fake._answer(req)
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("X-Elastic-Product", "Elasticsearch")
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.01,), name="fake-es", daemon=True)
        self._thread.start()

    def stop(self) -> None:
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


def error(status: int, type: str, reason: str, **extra: Any) -> dict[str, Any]:
    """An error answer as ES gives it: ``{"error": {root_cause, type, reason}, "status"}``."""
    cause = {"type": type, "reason": reason, **extra}
    return {"error": {"root_cause": [cause], **cause}, "status": status}


def bulk_answer(*statuses: int) -> Callable[[Recorded], dict[str, Any]]:
    """A ``_bulk`` answer: one ``create`` item per action line of the request, with the given
    statuses in order (201 created, 409 exists, 429 rejected, 400 mapping error, ...)."""

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
                    _seq_no=n,
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
            elif status == 400:
                item["error"] = {
                    "type": "document_parsing_exception",
                    "reason": "[1:2] failed to parse field [version] of type [long] in document",
                }
            else:
                item["error"] = {"type": "unavailable_shards_exception", "reason": "primary shard is not active"}
            items.append({"create": item})
        errors = any(s >= 300 for s in statuses)
        return {"errors": errors, "took": 3, "items": items}

    return answer


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
