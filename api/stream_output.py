"""The sending half of one WebSocket session: JSON events and binary audio frames, in order.

Several tasks of a session send (the receive loop's error frames, the speaking pipeline's audio),
so every send goes through one lock. A send that the client does not take within
`send_timeout_s` (`stream.send_timeout_s`: a reader stalled, or too slow for the audio) counts
as the peer gone, like a send that fails: `send_*` raise `PeerGone` from then on, `gone_event`
is set, and the session tears down (every request it had in flight is aborted).
"""

from __future__ import annotations

import asyncio
import json

from starlette.websockets import WebSocket


class PeerGone(Exception):
    """The client closed the socket, it broke, or it stopped taking frames; nothing more can be
    sent."""


class Outbound:
    def __init__(self, websocket: WebSocket, send_timeout_s: float) -> None:
        self._ws = websocket
        self._lock = asyncio.Lock()
        self.send_timeout_s = send_timeout_s
        self.gone_event = asyncio.Event()

    @property
    def gone(self) -> bool:
        return self.gone_event.is_set()

    async def send_json(self, event: dict) -> None:
        await self._send(text=json.dumps(event, ensure_ascii=False))

    async def send_bytes(self, data: bytes) -> None:
        await self._send(data=data)

    async def close(self, code: int, reason: str = "") -> None:
        """Close the socket (within the send timeout; a peer that does not take the close frame
        is left to the server to drop)."""
        if self.gone:
            return
        async with self._lock:
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    await self._ws.close(code, reason)
            except Exception:  # already closed by the peer, or it stopped reading
                pass
            finally:
                self.gone_event.set()

    async def _send(self, *, text: str | None = None, data: bytes | None = None) -> None:
        if self.gone:
            raise PeerGone()
        async with self._lock:
            if self.gone:  # gone while this send waited for the lock
                raise PeerGone()
            try:
                async with asyncio.timeout(self.send_timeout_s):
                    if text is not None:
                        await self._ws.send_text(text)
                    else:
                        await self._ws.send_bytes(data or b"")
            except Exception as exc:  # closed by the peer, the transport broke, or it stalled
                self.gone_event.set()
                raise PeerGone() from exc
