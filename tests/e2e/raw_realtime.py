"""A `/v1/realtime` client on a plain socket, for what a well-behaved client never does:
stop reading, or vanish with a TCP reset (SO_LINGER 0) instead of a closing handshake.
websockets' sans-I/O protocol does the framing; the socket is ours."""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri


class RawClient:
    def __init__(self, port: int, key: str, model: str = "omni", rcvbuf: int | None = None) -> None:
        self.proto = ClientProtocol(
            parse_uri(f"ws://127.0.0.1:{port}/v1/realtime?model={model}"), max_size=None
        )
        request = self.proto.connect()
        request.headers["Authorization"] = f"Bearer {key}"
        self.sock = socket.socket()
        if rcvbuf is not None:  # before connect: the window the server may fill
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.proto.send_request(request)
        self._flush()
        self.pending: list[dict[str, Any]] = []
        while self.proto.handshake_exc is None and not self._take():
            self.proto.receive_data(self.sock.recv(65536))
        assert self.proto.handshake_exc is None, self.proto.handshake_exc

    def _take(self) -> bool:
        """Queue the text frames received; whether anything (the handshake too) came."""
        events = self.proto.events_received()
        for frame in events:
            if isinstance(frame, Frame) and frame.opcode == Opcode.TEXT:
                self.pending.append(json.loads(bytes(frame.data)))
        return bool(events)

    def _flush(self) -> None:
        self.sock.sendall(b"".join(self.proto.data_to_send()))

    def send(self, ev: dict[str, Any]) -> None:
        self.proto.send_text(json.dumps(ev).encode())
        self._flush()

    def recv(self, deadline_s: float = 10.0) -> dict[str, Any]:
        """The next server event (pongs are the protocol's business)."""
        end = time.monotonic() + deadline_s
        while not self.pending:
            self._take()
            self._flush()  # pongs
            if self.pending:
                break
            assert time.monotonic() < end, "no server event before the deadline"
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            self.proto.receive_data(data)
        return self.pending.pop(0)

    def recv_until(self, kind: str, deadline_s: float = 10.0) -> dict[str, Any]:
        end = time.monotonic() + deadline_s
        while (ev := self.recv(max(0.0, end - time.monotonic())))["type"] != kind:
            pass
        return ev

    def close_code(self, deadline_s: float = 10.0) -> int:
        """The code of the server's close frame, once it comes."""
        end = time.monotonic() + deadline_s
        while self.proto.close_rcvd is None:
            assert time.monotonic() < end, "no close frame before the deadline"
            data = self.sock.recv(65536)
            assert data, "the connection closed with no close frame"
            self.proto.receive_data(data)
        return self.proto.close_rcvd.code

    def reset(self) -> None:
        """Vanish: RST, no close frame, no FIN."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()
