"""A loopback TCP proxy that misbehaves on purpose, in front of a real object-storage server.

Each HTTP request gets its own upstream connection (the proxy asks for ``Connection: close``),
so faults apply per request. ``proxy.set(fault, fraction)`` picks, for that fraction of the
requests from then on:

- ``"stall"``: read the request, never answer (a load balancer that swallows connections);
- ``"slowdown"``: answer ``503 SlowDown`` with an S3 XML error body, without asking upstream;
- ``"forbidden"``, ``"unauthorized"``: answer GCS's ``403`` (an account without the
  permission) or ``401`` (an invalid token) with its JSON error body, without asking upstream;
- ``"cut"``: close both connections halfway through the request body (uploads) or the response
  body (downloads);
- ``"trickle"``: relay the answer at ``rate_bytes_s`` bytes per second;
- ``"flip"``: invert one byte in the middle of the request body (an upload) or, for a request
  without a body, of the response body (a download): a bit error the TCP checksum missed.

With ``max_in_flight=N`` the fault hits only requests that arrive while N others are in
flight (a store that throttles above a request rate). ``proxy.set(None)`` heals it.
``proxy.faults`` counts the faults injected. Pure asyncio on a daemon thread; no pytest here.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading
from collections import Counter
from collections.abc import Iterator

HOST = "127.0.0.1"
FAULTS = ("stall", "slowdown", "cut", "trickle")  # the ones that cost time
CORRUPTING = ("flip",)
REFUSALS = ("forbidden", "unauthorized")
SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code><Message>"
            b"Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>")
CANNED = {  # fault: (status line, content type, body)
    "slowdown": (b"503 Slow Down", b"application/xml", SLOWDOWN),
    "forbidden": (b"403 Forbidden", b"application/json", b'{"error": {"code": 403, "message": '
                  b'"reader@p.iam.gserviceaccount.com does not have storage.objects.create '
                  b'access to the Google Cloud Storage object."}}'),
    "unauthorized": (b"401 Unauthorized", b"application/json",
                     b'{"error": {"code": 401, "message": "Invalid Credentials"}}')}


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """An HTTP message head up to and including the blank line; b"" at EOF."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return b""


def _content_length(head: bytes) -> int | None:
    found = re.search(rb"\r\ncontent-length:\s*(\d+)", head, re.IGNORECASE)
    return int(found.group(1)) if found else None


def _close_after(head: bytes) -> bytes:
    """``head`` with its Connection header replaced by ``Connection: close``."""
    head = re.sub(rb"\r\nconnection:[^\r]*", b"", head, flags=re.IGNORECASE)
    return head[:-2] + b"Connection: close\r\n\r\n"


class FaultProxy:
    """Listens on ``HOST:port`` and relays to ``upstream_port``; see the module docstring."""

    def __init__(self, upstream_port: int, seed: int = 0):
        self.upstream_port = upstream_port
        self.rng = random.Random(seed)
        self.fault: str | None = None
        self.fraction = 1.0
        self.rate_bytes_s = 4096
        self.max_in_flight: int | None = None
        self.only = b""
        self.max_faults: int | None = None
        self.in_flight = 0
        self.faults: Counter = Counter()
        self.requests = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="faultproxy")
        self._thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, HOST, 0), self.loop).result(5)
        self.port = self.server.sockets[0].getsockname()[1]
        self.endpoint_url = f"http://{HOST}:{self.port}"

    def set(self, fault: str | None, fraction: float = 1.0, rate_bytes_s: int = 4096,
            max_in_flight: int | None = None, only: bytes | re.Pattern = b"",
            max_faults: int | None = None) -> None:
        """Injects ``fault`` (one of FAULTS or CORRUPTING, or None to heal) into ``fraction`` of
        requests (of those beyond ``max_in_flight`` concurrent ones, if given) whose request
        line contains ``only`` (bytes), or matches it (a compiled bytes pattern: ``search``),
        until ``faults[fault]`` reaches ``max_faults`` (None: no end)."""
        if fault is not None and fault not in FAULTS + CORRUPTING + REFUSALS:
            raise ValueError(f"unknown fault {fault!r}")
        self.fault, self.fraction, self.rate_bytes_s = fault, fraction, rate_bytes_s
        self.max_in_flight, self.only, self.max_faults = max_in_flight, only, max_faults

    def close(self) -> None:
        async def stop():
            self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        upstream_w, head = None, b""
        try:
            head = await _read_head(client_r)
            if not head:
                return
            self.requests += 1
            self.in_flight += 1
            busy = self.max_in_flight is None or self.in_flight > self.max_in_flight
            line = head.split(b"\r\n", 1)[0]
            busy = busy and (self.only.search(line) is not None
                             if isinstance(self.only, re.Pattern) else self.only in line)
            busy = busy and (self.max_faults is None or self.faults[self.fault] < self.max_faults)
            fault = self.fault if busy and self.rng.random() < self.fraction else None
            if fault:
                self.faults[fault] += 1
            if fault == "stall":
                while await client_r.read(65536):  # swallow everything, answer nothing
                    pass
                return
            length = _content_length(head) or 0
            if fault in CANNED:
                if b"100-continue" not in head.lower():
                    await client_r.readexactly(length)
                status, kind, body = CANNED[fault]
                client_w.write(b"HTTP/1.1 %s\r\nContent-Type: %s\r\nConnection: close\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (status, kind, len(body), body))
                await client_w.drain()
                return
            upstream_r, upstream_w = await asyncio.open_connection(HOST, self.upstream_port)
            upstream_w.write(_close_after(head))
            if fault == "cut" and length > 1:
                upstream_w.write(await client_r.readexactly(length // 2))
                await upstream_w.drain()
                return  # both connections closed mid-body
            flip_upload = fault == "flip" and length > 0
            up = asyncio.ensure_future(self._flip(client_r, upstream_w, length) if flip_upload
                                       else self._pipe(client_r, upstream_w))
            fault = None if flip_upload else fault  # the answer goes back as it is
            try:
                await self._answer(upstream_r, client_w, fault)
            finally:
                up.cancel()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            if head:
                self.in_flight -= 1
            for w in (client_w, upstream_w):
                if w is not None:
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _flip(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    length: int) -> None:
        """Relays a request body of ``length`` bytes with its middle byte inverted (the answer
        is relayed meanwhile: a client may wait for ``100 Continue`` before sending it)."""
        body = bytearray(await reader.readexactly(length))
        body[length // 2] ^= 0xFF
        writer.write(body)
        await writer.drain()

    async def _answer(self, upstream_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                      fault: str | None) -> None:
        """Relays the upstream answer to the client, cut or trickled as ``fault`` says."""
        if fault in ("cut", "flip"):
            head = await _read_head(upstream_r)
            length = _content_length(head) or 0
            if fault == "cut":
                client_w.write(head + await upstream_r.readexactly(length // 2))
                await client_w.drain()
                return
            body = bytearray(await upstream_r.readexactly(length))
            if length:
                body[length // 2] ^= 0xFF
            client_w.write(head + body)
            await client_w.drain()
            return
        if fault != "trickle":
            await self._pipe(upstream_r, client_w)
            return
        piece = max(1, self.rate_bytes_s // 20)
        while data := await upstream_r.read(piece):
            client_w.write(data)
            await client_w.drain()
            await asyncio.sleep(len(data) / self.rate_bytes_s)


@contextlib.contextmanager
def fault_proxy(upstream_url: str, seed: int = 0) -> Iterator[FaultProxy]:
    """A FaultProxy in front of ``http://127.0.0.1:PORT`` (``upstream_url``), closed on exit."""
    proxy = FaultProxy(int(upstream_url.rsplit(":", 1)[1].rstrip("/")), seed)
    try:
        yield proxy
    finally:
        proxy.close()
