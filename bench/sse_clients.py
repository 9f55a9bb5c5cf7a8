"""Many closed-loop streaming clients in one thread: the load generator of bench/load.py.

On a 2-core machine the load generator shares the CPU with the server it measures, so its own
cost shows in the figures. Measured per server-sent event on a 2-core Zen 4: httpx's streaming
client about 250 us of CPU, http.client about 130 us, a socket read about 65 us (a wake-up per
event). Here every client is a non-blocking socket on one selector: the answers that gain a token
in the same engine step are read in one wake-up, and the events are found with a byte search.

Each client asks its next question as soon as its answer is complete (a new connection per
question). Times are ``time.perf_counter`` seconds, taken when the bytes of an event are read.
"""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit


class ClientError(RuntimeError):
    """The server answered a question with an error status, or closed the stream early."""


@dataclass
class _Stream:
    body: dict
    t0: float
    sock: socket.socket
    raw: bytearray = field(default_factory=bytearray)  # bytes read, not yet decoded
    data: bytearray = field(default_factory=bytearray)  # decoded body, not yet parsed
    headers_done: bool = False
    chunked: bool = False
    token_times: list[float] = field(default_factory=list)
    final: dict | None = None
    done: bool = False

    def feed(self, chunk: bytes, now: float) -> None:
        self.raw += chunk
        if not self.headers_done:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.raw[:end]).decode("latin-1")
            del self.raw[: end + 4]
            status = head.split("\r\n", 1)[0].split()
            if len(status) < 2 or status[1] != "200":
                detail = bytes(self.raw[:300]).decode("utf-8", "replace")
                raise ClientError(f"{head.splitlines()[0]}: {detail}")
            self.chunked = "transfer-encoding: chunked" in head.lower()
            self.headers_done = True
        if self.chunked:
            self._dechunk()
        else:
            self.data += self.raw
            self.raw.clear()
        self._events(now)

    def _dechunk(self) -> None:
        while True:
            eol = self.raw.find(b"\r\n")
            if eol < 0:
                return
            size = int(bytes(self.raw[:eol]).split(b";", 1)[0], 16)
            if size == 0:
                self.done = True
                del self.raw[:]
                return
            if len(self.raw) < eol + 2 + size + 2:
                return
            self.data += self.raw[eol + 2 : eol + 2 + size]
            del self.raw[: eol + 2 + size + 2]

    def _events(self, now: float) -> None:
        while True:
            end = self.data.find(b"\n\n")
            if end < 0:
                return
            event = bytes(self.data[:end])
            del self.data[: end + 2]
            if event.startswith(b"event: token"):
                self.token_times.append(now)
            elif event.startswith(b"event: answer"):
                line = event.split(b"\n", 1)[1]
                self.final = json.loads(line[len(b"data: ") :])


def run_clients(
    url: str,
    headers: dict[str, str],
    next_body: Callable[[], dict | None],
    starts: list[float],
    on_result: Callable[[dict, list[float], float, float, dict], None],
    timeout_s: float = 900.0,
) -> None:
    """Run one closed-loop client per entry of ``starts`` (seconds from now at which each asks
    its first question) against ``POST /v1/ask`` with ``stream: true`` bodies from
    ``next_body`` (None when the work is done). Calls ``on_result(body, token_times, t0, end,
    final_answer)`` for each answer. Raises ClientError on an error status or a stream that
    ends without its answer, TimeoutError when nothing arrives for ``timeout_s``."""
    parts = urlsplit(url)
    addr = (parts.hostname or "127.0.0.1", parts.port or 80)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sel = selectors.DefaultSelector()
    t_begin = time.perf_counter()
    pending = sorted(t_begin + s for s in starts)  # clients yet to ask their first question
    active = 0

    def ask() -> bool:
        body = next_body()
        if body is None:
            return False
        payload = json.dumps(body).encode()
        sock = socket.create_connection(addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(
            (
                f"POST /v1/ask HTTP/1.1\r\nHost: {addr[0]}:{addr[1]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                f"Connection: close\r\n{extra}\r\n"
            ).encode()
            + payload
        )
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, _Stream(body, t0, sock))
        return True

    try:
        while pending or active:
            now = time.perf_counter()
            while pending and pending[0] <= now:
                pending.pop(0)
                active += ask()
            wait = max(0.0, pending[0] - now) if pending else timeout_s
            ready = sel.select(wait)
            if not ready and not pending and active:
                raise TimeoutError(f"no bytes from the server in {timeout_s:.0f} s")
            now = time.perf_counter()
            for key, _ in ready:
                st: _Stream = key.data
                try:
                    chunk = st.sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                if chunk:
                    st.feed(chunk, now)
                if chunk and not st.done:
                    continue
                sel.unregister(st.sock)
                st.sock.close()
                active -= 1
                if st.final is None:
                    raise ClientError(f"the stream ended without an answer for {st.body}")
                on_result(st.body, st.token_times, st.t0, now, st.final)
                active += ask()
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
