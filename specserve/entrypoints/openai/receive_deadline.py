"""A deadline on receiving each request, so that slow or stalled clients cannot hold connections open.

uvicorn times out only idle keep-alive connections, and any byte received stops that clock: a client that
sends half its headers, or trickles them a byte at a time, holds its connection (a socket, a buffer) for
as long as it likes, and enough such clients take every connection the host allows. ASGI middleware
cannot help: an app is called only once the headers are whole.

So each connection's protocol (uvicorn's own, subclassed) gets a deadline: a client has `timeout_s`
seconds from connecting, or from the end of the previous answer on the connection, to send a whole request,
headers and body. A request received whole is answered for as long as the answer takes (a long stream
included); the deadline starts again when that answer is complete. At the deadline a client still sending
headers is answered 408 and disconnected; one still sending a body is disconnected, which the app sees as
the client leaving.

An answer given before its request's body has arrived whole (a body refused for its size) closes with a
lingering close: the server half-closes (the answer, then its end), then reads and drops whatever the client
still sends until the client closes or LINGER_S pass. Closed at once, the socket would hold unread bytes,
and the kernel answers a close over unread bytes with a reset, which can reach the client before it has read
the answer, and lose it.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specserve.entrypoints.openai.errors import OpenAIError

# The longest the server reads and drops a refused body's remainder after answering.
LINGER_S = 2.0


class _LingeringTransport:
    """The connection's transport as uvicorn's protocol sees it: its close() lingers while the protocol's
    request still has body to come (protocol.unread_body()); everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol):
        self.inner, self._protocol = transport, protocol
        self.lingering = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def is_closing(self) -> bool:
        return self.lingering or self.inner.is_closing()

    def close(self) -> None:
        if self.lingering or self.inner.is_closing():
            return
        if not self._protocol.unread_body() or not self.inner.can_write_eof():
            self.inner.close()
            return
        self.lingering = True
        self.inner.write_eof()  # the answer, then the end of the server's side
        self.inner.resume_reading()  # uvicorn pauses reading while a body waits unread
        self._protocol.linger(LINGER_S)


def receive_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, else h11) with a deadline on receiving requests;
    given to uvicorn.Config as `http`."""
    body = OpenAIError(408, f"the request was not received whole within {timeout_s:g} s; send its headers and body "
                       "at once (the server's --receive-timeout sets the limit)", code="request_timeout").encoded()
    timed_out = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)) + body

    class ReceiveDeadlineProtocol(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            self._own = _LingeringTransport(transport, self)
            super().connection_made(self._own)
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def unread_body(self) -> bool:
            return self.cycle is not None and self.cycle.more_body

        def linger(self, seconds: float) -> None:
            self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._own.inner.close)

        def data_received(self, data: bytes) -> None:
            if not self._own.lingering:  # lingering, what comes is a refused body's rest: dropped
                super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._own.lingering:
                return
            self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def connection_lost(self, exc) -> None:
            self._deadline.cancel()
            super().connection_lost(exc)

        def _expire(self) -> None:
            cycle = self.cycle  # the latest request whose headers arrived whole
            if cycle is not None and not cycle.more_body and not cycle.response_complete:
                return  # received whole and being answered
            if self.transport.is_closing():
                return
            if cycle is None or cycle.response_complete:  # nothing is being answered: there is room for a 408
                self.transport.write(timed_out)
            self._own.inner.close()  # cut off, without lingering

    return ReceiveDeadlineProtocol

