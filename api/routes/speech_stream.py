"""`WS /v1/audio/speech/stream`: text in as it is written, audio out as it is made.

The socket is served by `api.stream_socket.serve_socket` (session places, the receive loop, the
idle timeout `stream.idle_timeout_s`, the end of a session however it comes); its messages are in
`api.stream_protocol`, and each goes to the `SpeechSession`.
"""

from __future__ import annotations

from starlette.websockets import WebSocket

from api.errors import ApiError
from api.stream_output import Outbound
from api.stream_protocol import OmniEvents, decode_message, error_event
from api.stream_session import SpeechSession
from api.stream_socket import SocketSession, serve_socket


class OmniSocket(SocketSession):
    """`/v1/audio/speech/stream`'s session: its messages (`api.stream_protocol`) to a
    `SpeechSession`."""

    def __init__(self, state, out: Outbound) -> None:
        self.idle_s = state.profile.stream.idle_timeout_s
        self.idle_source = self.idle_limit = "stream.idle_timeout_s"
        self.session = SpeechSession(state, OmniEvents(out))
        self.out = out

    @property
    def busy(self) -> bool:
        return self.session.busy

    def error_message(self, exc: ApiError) -> dict:
        return error_event(exc)

    async def receive(self, text: str) -> bool:
        try:
            msg = decode_message(text)
        except ApiError as exc:
            await self.out.send_json(error_event(exc))
            return True
        return await self.session.handle(msg)

    async def close(self) -> None:
        await self.session.close()


async def speech_stream(websocket: WebSocket) -> None:
    """`WS /v1/audio/speech/stream`."""
    state = websocket.state.api
    await serve_socket(websocket, lambda out: OmniSocket(state, out))
