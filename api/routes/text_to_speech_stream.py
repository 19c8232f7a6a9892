"""ElevenLabs' text-to-speech WebSockets: ``/v1/text-to-speech/{voice_id}/stream-input`` (one
stream of text) and ``/v1/text-to-speech/{voice_id}/multi-stream-input`` (contexts).

Served by `api.stream_socket.serve_socket` like every speech socket (session places, the receive
loop, the idle timeout: the handshake's ``inactivity_timeout``, then an error and close 1008); the
messages are in `api.elevenlabs_protocol`, what they do in `api.elevenlabs_session`.
"""

from __future__ import annotations

from starlette.websockets import WebSocket

from api.elevenlabs_session import ElevenLabsSocket
from api.stream_socket import serve_socket


async def stream_input(websocket: WebSocket) -> None:
    """`WS /v1/text-to-speech/{voice_id}/stream-input`."""
    state = websocket.state.api
    await serve_socket(websocket, lambda out: ElevenLabsSocket(state, out, websocket, multi=False))


async def multi_stream_input(websocket: WebSocket) -> None:
    """`WS /v1/text-to-speech/{voice_id}/multi-stream-input`."""
    state = websocket.state.api
    await serve_socket(websocket, lambda out: ElevenLabsSocket(state, out, websocket, multi=True))
