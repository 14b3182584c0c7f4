"""A local HTTP endpoint that answers Elasticsearch bulk requests instantly (a separate process,
so that it does not share the client's CPU).

``python -m bench.es_endpoint PORT_FILE`` listens on 127.0.0.1 (a free port, written to
``PORT_FILE``). ``POST .../_bulk`` answers every ``create`` with 201 and its ``_id`` (``errors:
false``), as Elasticsearch does, counting request bodies and their bytes; ``GET /_bench/stats``
answers ``{requests, bytes, refreshes, update_by_query}``; ``POST /_bench/reset`` zeroes them;
``GET <index>/_mapping`` answers the events mapping; ``_refresh`` and ``_update_by_query``
answer as Elasticsearch does (counted; an update by query changes nothing), ``_mget`` finds no
document and ``_msearch`` no hit; anything else answers ``{}``. Every answer carries
``X-Elastic-Product: Elasticsearch`` (the client's product check refuses one without it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def _item(action: bytes) -> bytes:
    _id = json.dumps(json.loads(action)["create"]["_id"]).encode()
    return b'{"create":{"_index":"bench","_id":%b,"status":201,"result":"created","_version":1}}' % _id


class _Stats:
    requests = 0
    bytes = 0
    refreshes = 0
    update_by_query = 0


def _answer(status: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nX-Elastic-Product: Elasticsearch\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = await reader.readexactly(length) if length else b""
            path = target.split("?", 1)[0]
            if path.endswith("/_bulk"):
                _Stats.requests += 1
                _Stats.bytes += len(body)
                actions = body.split(b"\n")[0:-1:2]
                out = b'{"errors":false,"took":0,"items":[' + b",".join(_item(a) for a in actions) + b"]}"
            elif path.endswith("/_refresh"):
                _Stats.refreshes += 1
                out = b'{"_shards":{"total":1,"successful":1,"failed":0}}'
            elif path.endswith("/_update_by_query"):
                _Stats.update_by_query += 1
                out = (
                    b'{"took":1,"timed_out":false,"total":0,"updated":0,"deleted":0,"batches":0,'
                    b'"version_conflicts":0,"noops":0,"failures":[]}'
                )
            elif path.endswith("/_mget"):
                docs = json.loads(body).get("docs", [])
                out = json.dumps(
                    {"docs": [{"_index": "bench", "_id": d["_id"], "found": False} for d in docs]}
                ).encode()
            elif path.endswith("/_msearch"):
                n = body.count(b"\n") // 2
                hits = {"total": {"value": 0, "relation": "eq"}, "hits": []}
                out = json.dumps({"took": 1, "responses": [{"status": 200, "hits": hits}] * n}).encode()
            elif path.endswith("/_mapping"):  # the sink's check of the index (ddl none)
                from wowd.stores.elasticsearch.documents import events_mapping

                out = json.dumps({path.strip("/").split("/")[0]: {"mappings": events_mapping()}}).encode()
            elif path == "/_bench/stats":
                stats = {"requests": _Stats.requests, "bytes": _Stats.bytes, "refreshes": _Stats.refreshes}
                out = json.dumps({**stats, "update_by_query": _Stats.update_by_query}).encode()
            elif path == "/_bench/reset":
                _Stats.requests = _Stats.bytes = _Stats.refreshes = _Stats.update_by_query = 0
                out = b"{}"
            else:
                out = b"{}"
            del method
            writer.write(_answer("200 OK", out))
            await writer.drain()
    finally:
        writer.close()


async def _main(port_file: Path) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0, limit=1 << 26)
    port = server.sockets[0].getsockname()[1]
    tmp = port_file.with_name(port_file.name + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(port_file)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(Path(sys.argv[1])))
