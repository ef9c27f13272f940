"""A Unix socket between a Serve replica and its scheduler actor on the same node: requests in,
every step's outputs out, one length-prefixed pickle per message.

A Ray actor call and a streaming-generator item each cross Ray's core workers (gRPC, the
caller's and the actor's event loop hand-offs): on the 2-core machine, one request at a time,
the call took ~5 ms to reach the actor and the first output ~4 ms to come back, most of the
time-to-first-token tax (docs/benchmarks.md, "Where the time-to-first-token tax goes"). A frame
on a Unix socket is read by the other side's event loop as soon as it is written.

The socket lives in Linux's abstract namespace (no file to leave behind when the actor is
killed); only processes of the actor's own user may talk on it (SO_PEERCRED). Where that does
not work (another OS, another node, a network namespace between them) the replica talks to the
actor through Ray as before (app/serving/replica.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import secrets
import socket
import struct
import sys

from actors.errors import EngineDeadError
from actors.request import EngineRequest

HEADER = struct.Struct("!I")
PEERCRED = struct.Struct("3i")  # pid, uid, gid


async def read_message(reader: asyncio.StreamReader):
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def write_message(writer: asyncio.StreamWriter, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(HEADER.pack(len(data)) + data)


def same_user(writer: asyncio.StreamWriter) -> bool:
    sock = writer.get_extra_info("socket")
    _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return uid == os.getuid()


class LinkServer:
    """The scheduler actor's end. `actor` has `add(...)`, `abort(request_id)` and `outbox`
    (actors/host/engine_actor.py); each connection becomes the outbox's reader, as a new
    `outputs` stream does."""

    def __init__(self, actor):
        self.actor = actor
        self.address: str | None = None
        self.server: asyncio.AbstractServer | None = None
        self.adding: dict[str, asyncio.Task] = {}

    async def start(self) -> str | None:
        """The address to connect to, or None where abstract Unix sockets do not exist."""
        if self.address is None and sys.platform == "linux":
            self.address = f"\0shoal-engine-{os.getpid()}-{secrets.token_hex(8)}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # (uvloop takes no
            sock.bind(self.address)  # abstract path: it stops at the NUL)
            self.server = await asyncio.start_unix_server(self._serve, sock=sock)
        return self.address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not same_user(writer):
            writer.close()
            return
        outbox = self.actor.outbox
        sender = asyncio.create_task(self._send(outbox, outbox.open_reader(), writer))
        try:
            while True:
                message = await read_message(reader)
                if message[0] == "add":
                    request_id = message[1].request_id
                    self.adding[request_id] = task = asyncio.create_task(self._add(writer, message[1]))
                    task.add_done_callback(lambda _, rid=request_id: self.adding.pop(rid, None))
                else:  # ("abort", request id); an add still compiling its grammar is cancelled
                    task = self.adding.get(message[1])
                    if task is not None:
                        task.cancel()
                    self.actor.abort(message[1])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the replica went away
        finally:
            sender.cancel()
            writer.close()

    async def _add(self, writer: asyncio.StreamWriter, request: EngineRequest) -> None:
        try:
            await self.actor.add(request)
            error = None
        except asyncio.CancelledError:
            return
        except Exception as exc:  # noqa: BLE001 - the refusal goes back to the caller
            error = exc
        with contextlib.suppress(ConnectionError):
            write_message(writer, ("added", request.request_id, error))

    @staticmethod
    async def _send(outbox, reader: int, writer: asyncio.StreamWriter) -> None:
        """Each step's news, until a newer reader took over (then the replica sees the
        socket close, fails what it had in flight, and connects again)."""
        try:
            while (batch := await outbox.take(reader)) is not None:
                write_message(writer, ("outputs", batch))
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()


class SocketLink:
    """The replica's end: `add` waits for the actor's answer (its refusal is raised here),
    `batches` yields each step's [(request id, delta, error)]."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.answers: dict[str, asyncio.Future] = {}
        self.broken: BaseException | None = None

    @classmethod
    async def open(cls, address: str) -> "SocketLink":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(address)  # at once on a Unix socket (uvloop takes no abstract path)
        except OSError:
            sock.close()
            raise
        return cls(*await asyncio.open_unix_connection(sock=sock))

    async def add(self, request: EngineRequest) -> None:
        if self.broken is not None:
            raise self.broken
        answer = self.answers[request.request_id] = asyncio.get_running_loop().create_future()
        try:
            write_message(self.writer, ("add", request))
            error = await answer
        finally:
            self.answers.pop(request.request_id, None)
        if error is not None:
            raise error

    def abort(self, request_id: str) -> None:
        if self.broken is None:
            write_message(self.writer, ("abort", request_id))

    async def batches(self):
        try:
            while True:
                kind, *body = await read_message(self.reader)
                if kind == "outputs":
                    yield body[0]
                elif (answer := self.answers.get(body[0])) is not None and not answer.done():
                    answer.set_result(body[1])
        except Exception as exc:  # noqa: BLE001 - the actor died, or took another reader
            self.close(EngineDeadError(f"the engine's socket closed ({exc!r})"))
            raise self.broken from None
        except BaseException:  # cancelled: the replica stops
            self.close(EngineDeadError("the replica closed the engine's socket"))
            raise

    def close(self, reason: BaseException) -> None:
        self.broken = reason
        for answer in self.answers.values():
            if not answer.done():
                answer.set_exception(self.broken)
        self.writer.close()
