"""The sending half of one WebSocket session: JSON events and binary audio frames, in order.

Several tasks of a session send (the receive loop's error frames, the speaking pipeline's audio),
so every send goes through one lock. Once a send fails the peer is gone: `send_*` raise
`PeerGone` from then on, and the session tears down.
"""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocket


class PeerGone(Exception):
    """The client closed the socket (or it broke); nothing more can be sent."""


class Outbound:
    def __init__(self, websocket: WebSocket) -> None:
        self._ws = websocket
        self._lock = asyncio.Lock()
        self.gone = False

    async def send_json(self, event: dict) -> None:
        await self._send(text=json.dumps(event, ensure_ascii=False))

    async def send_bytes(self, data: bytes) -> None:
        await self._send(data=data)

    async def _send(self, *, text: str | None = None, data: bytes | None = None) -> None:
        if self.gone:
            raise PeerGone()
        async with self._lock:
            try:
                if text is not None:
                    await self._ws.send_text(text)
                else:
                    await self._ws.send_bytes(data or b"")
            except Exception as exc:  # closed by the peer, or the transport broke
                self.gone = True
                raise PeerGone() from exc
