"""The MongoDB wire protocol of the simulator: ``OP_MSG`` (every command of a 3.6+ driver) and
``OP_QUERY`` on ``<db>.$cmd`` (the driver's first ``hello`` of a connection), answered with
``OP_MSG`` and ``OP_REPLY`` (manual, "MongoDB Wire Protocol").

A threaded TCP server: one thread per connection, each request handed to a
:class:`~tests.mongosim.engine.Engine`, which answers a command document. A message over
``maxMessageSizeBytes`` (48,000,000) closes the connection, as the server does (it logs
"recv(): message msgLen ... is invalid").
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from typing import TYPE_CHECKING, Any

import bson
from bson.codec_options import CodecOptions

if TYPE_CHECKING:
    from tests.mongosim.engine import Engine

__all__ = ["MAX_MESSAGE_BYTES", "OP_MSG", "OP_QUERY", "OP_REPLY", "ProtocolError", "WireServer"]

logger = logging.getLogger(__name__)

OP_REPLY = 1
OP_QUERY = 2004
OP_COMPRESSED = 2012
OP_MSG = 2013
MAX_MESSAGE_BYTES = 48_000_000
"""``maxMessageSizeBytes`` (src/mongo/rpc/message.h: MaxMessageSizeBytes)."""
_HEADER = struct.Struct("<iiii")
_CHECKSUM_PRESENT = 1
_MORE_TO_COME = 2
DECODE = CodecOptions(document_class=dict, tz_aware=False)


class ProtocolError(Exception):
    """A message the server would not parse: the connection is closed."""


def parse_op_msg(payload: bytes) -> tuple[int, dict[str, Any]]:
    """``(flagBits, command)`` of an OP_MSG body: the kind-0 section is the command, each kind-1
    section (a document sequence, e.g. ``documents`` of an ``insert``) becomes its array."""
    (flags,) = struct.unpack_from("<I", payload, 0)
    if flags & ~(_CHECKSUM_PRESENT | _MORE_TO_COME | (1 << 16)):
        raise ProtocolError(f"OP_MSG with unknown required flag bits {flags:#x}")
    end = len(payload) - (4 if flags & _CHECKSUM_PRESENT else 0)
    pos = 4
    body: dict[str, Any] | None = None
    sequences: dict[str, list[Any]] = {}
    while pos < end:
        kind = payload[pos]
        pos += 1
        if kind == 0:
            (size,) = struct.unpack_from("<i", payload, pos)
            if body is not None:
                raise ProtocolError("OP_MSG with more than one body section")
            body = bson.decode(payload[pos : pos + size], DECODE)
            pos += size
        elif kind == 1:
            (size,) = struct.unpack_from("<i", payload, pos)
            section_end = pos + size
            nul = payload.index(b"\x00", pos + 4)
            ident = payload[pos + 4 : nul].decode()
            docs = bson.decode_all(payload[nul + 1 : section_end], DECODE)
            sequences.setdefault(ident, []).extend(docs)
            pos = section_end
        else:
            raise ProtocolError(f"OP_MSG with unknown section kind {kind}")
    if body is None:
        raise ProtocolError("OP_MSG without a body section")
    for ident, docs in sequences.items():
        if ident in body:
            raise ProtocolError(f"OP_MSG: {ident!r} both in the body and as a document sequence")
        body[ident] = docs
    return flags, body


def op_msg(request_id: int, response_to: int, doc: dict[str, Any]) -> bytes:
    data = struct.pack("<IB", 0, 0) + bson.encode(doc)
    return _HEADER.pack(16 + len(data), request_id, response_to, OP_MSG) + data


def op_reply(request_id: int, response_to: int, doc: dict[str, Any]) -> bytes:
    data = struct.pack("<iqii", 8, 0, 0, 1) + bson.encode(doc)  # flags: AwaitCapable
    return _HEADER.pack(16 + len(data), request_id, response_to, OP_REPLY) + data


def parse_op_query(payload: bytes) -> tuple[str, dict[str, Any]]:
    """``(database, command)`` of an OP_QUERY on ``<db>.$cmd`` (any other namespace: refused)."""
    pos = 4
    nul = payload.index(b"\x00", pos)
    ns = payload[pos:nul].decode()
    pos = nul + 1 + 8  # numberToSkip, numberToReturn
    (size,) = struct.unpack_from("<i", payload, pos)
    query = bson.decode(payload[pos : pos + size], DECODE)
    db, _, coll = ns.partition(".")
    if coll != "$cmd":
        raise ProtocolError(f"OP_QUERY on {ns!r}: only commands are served")
    if "$query" in query:
        query = dict(query["$query"])
    return db, query


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        engine = self.server.engine
        conn = engine.connect(sock)
        try:
            while True:
                header = _recv_exactly(sock, 16)
                length, request_id, _, opcode = _HEADER.unpack(header)
                if length < 16 or length > MAX_MESSAGE_BYTES:
                    logger.warning("mongosim: message of %d bytes: connection closed", length)
                    return
                payload = _recv_exactly(sock, length - 16)
                if opcode == OP_MSG:
                    flags, cmd = parse_op_msg(payload)
                    reply = engine.run(conn, cmd)
                    if flags & _MORE_TO_COME:
                        continue  # an unacknowledged write: no answer
                    out = op_msg(engine.next_request_id(), request_id, reply)
                elif opcode == OP_QUERY:
                    db, cmd = parse_op_query(payload)
                    cmd["$db"] = db
                    out = op_reply(engine.next_request_id(), request_id, engine.run(conn, cmd))
                else:
                    logger.warning("mongosim: opcode %d is not served: connection closed", opcode)
                    return
                sock.sendall(out)
        except (ConnectionError, OSError):
            return
        except ProtocolError as exc:
            logger.warning("mongosim: %s: connection closed", exc)
        finally:
            engine.disconnect(conn)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], engine: Engine) -> None:
        self.engine = engine
        super().__init__(address, _Handler)


class WireServer:
    """The listening socket and its thread; ``port`` 0 picks a free one."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self._server = _Server((host, port), engine)
        self.host = host
        self.port = int(self._server.server_address[1])
        engine.address = f"{host}:{self.port}"
        # the accept loop's poll: how long a stop waits for it (every test with a simulator stops one)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.01,), name="mongosim", daemon=True)

    @property
    def uri(self) -> str:
        if self.engine.shards:  # a mongos: no replica set to name
            return f"mongodb://{self.host}:{self.port}/"
        return f"mongodb://{self.host}:{self.port}/?replicaSet={self.engine.set_name}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.engine.shutdown()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
