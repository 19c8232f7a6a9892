"""ElevenLabs' text-to-speech WebSockets end to end, against a real `mossvox serve` on loopback
(tiny demo model, cpu profile, an API key): the official `elevenlabs` SDK's WebSocket helper, and
a client written to the messages of ElevenLabs' API reference for what the SDK does not cover
(the multi-context socket, flush, the key in the first message, close_context as barge-in).

Output is `pcm_48000`, the model's own rate, so each sentence's length is exact: the cpu profile
forces it from the sentence's text (random weights stop at random).
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
import websockets
from elevenlabs.client import ElevenLabs

from tests.api.helpers import FRAMES_PER_CHAR, aborted, engine_gauges, wait_idle
from tests.api.server_process import ServerProcess

KEY = "xi-ws-test-81c2"
BYTES_PER_FRAME = 3840 * 2  # 80 ms of 48 kHz mono s16
SENTENCES = ["The first sentence is complete here.", "A second one follows, with a comma!",
             "And a third one ends the story."]
LONG = "This sentence goes on and on " * 12 + "until it ends."  # about 30 s of audio
PCM = "output_format=pcm_48000"


def frames(text: str) -> int:
    return max(1, round(FRAMES_PER_CHAR * len(text)))


def spoken_bytes(*sentences: str) -> int:
    return sum(frames(s) for s in sentences) * BYTES_PER_FRAME


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), "--api-key", KEY,
                      sets=("stream.max_contexts=2",)).start()
    yield s
    s.stop()


def url(server, path: str, query: str = PCM) -> str:
    return server.url.replace("http://", "ws://") + f"/v1/text-to-speech/default/{path}?{query}"


def connect(server, path: str = "stream-input", query: str = PCM, key: str | None = KEY):
    headers = {"xi-api-key": key} if key is not None else {}
    return websockets.connect(url(server, path, query), additional_headers=headers, max_size=None)


async def receive(ws, timeout: float = 60.0) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def read_until_final(ws, context: str | None = None, timeout: float = 60.0) -> tuple[dict[str | None, int], dict]:
    """Audio bytes per context until the `isFinal` of `context` (or of the single stream)."""
    got: dict[str | None, int] = {}
    while True:
        message = await receive(ws, timeout)
        assert "error" not in message, message
        if message.get("isFinal") and message.get("contextId") == context:
            return got, message
        if "audio" in message:
            key = message.get("contextId")
            got[key] = got.get(key, 0) + len(base64.b64decode(message["audio"]))


def test_the_sdk_streams_text_in_and_audio_out(server):
    def text():  # as an LLM writes it: words, not sentences
        for word in " ".join(SENTENCES).split(" "):
            yield word + " "

    client = ElevenLabs(api_key=KEY, base_url=server.url)
    # the helper always dials wss:// (it swaps the base URL's scheme); this server is plain loopback
    client.text_to_speech._ws_base_url = server.url.replace("http://", "ws://")
    audio = b"".join(client.text_to_speech.convert_realtime("default", text=text(), output_format="pcm_48000",
                                                            model_id="eleven_flash_v2_5"))
    assert len(audio) == spoken_bytes(*SENTENCES)


async def test_the_first_sentence_is_heard_before_the_text_ends(server):
    """The key in the first message (none in the handshake), a flush, then the empty text that
    ends the stream: the rest is spoken, isFinal, and the socket closes normally."""
    async with connect(server, key=None) as ws:
        await ws.send(json.dumps({"text": " ", "xi_api_key": KEY, "voice_settings": {"stability": 0.5},
                                  "generation_config": {"chunk_length_schedule": [120, 160]}}))
        await ws.send(json.dumps({"text": SENTENCES[0] + " " + SENTENCES[1][:9]}))
        first = await receive(ws)
        assert first["audio"]  # the complete sentence speaks while the next is still being written
        await ws.send(json.dumps({"text": SENTENCES[1][9:] + " ", "flush": True}))
        await ws.send(json.dumps({"text": SENTENCES[2] + " "}))
        await ws.send(json.dumps({"text": ""}))
        got, final = await read_until_final(ws)
        with pytest.raises(websockets.ConnectionClosedOK):
            await receive(ws)
    assert len(base64.b64decode(first["audio"])) + got[None] == spoken_bytes(*SENTENCES)
    assert final == {"isFinal": True, "ignored_fields": ["generation_config.chunk_length_schedule",
                                                         "voice_settings.stability"]}


async def test_a_missing_or_wrong_key_closes_the_socket(server):
    async with connect(server, key=None) as ws:
        await ws.send(json.dumps({"text": " ", "xi-api-key": "wrong"}))
        error = await receive(ws)
        assert error["error"] == "invalid_api_key" and error["code"] == 401 and error["message"]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await receive(ws)
        assert closed.value.rcvd.code == 1008
    with pytest.raises(websockets.InvalidStatus):  # a wrong key in the handshake: refused there
        async with connect(server, key="wrong"):
            pass
    # a voice is looked up only for a client with the key: without one, no name is confirmed
    keyless = server.url.replace("http://", "ws://") + "/v1/text-to-speech/nobody-here/stream-input"
    async with websockets.connect(keyless) as ws:
        await ws.send(json.dumps({"text": " "}))
        assert (await receive(ws))["error"] == "invalid_api_key"
    async with websockets.connect(keyless) as ws:
        await ws.send(json.dumps({"text": " ", "xi-api-key": KEY}))
        assert (await receive(ws))["error"] == "voice_not_found"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await receive(ws)
        assert closed.value.rcvd.code == 1008


async def test_contexts_speak_side_by_side_and_end_with_is_final(server):
    query = PCM + "&model_id=eleven_flash_v2_5&sync_alignment=true&auto_mode=true&inactivity_timeout=180"
    async with connect(server, "multi-stream-input", query) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "a"}))
        await ws.send(json.dumps({"text": SENTENCES[0] + " ", "context_id": "a"}))
        await ws.send(json.dumps({"text": " ", "context_id": "b", "voice_settings": {"speed": 1.0}}))
        await ws.send(json.dumps({"text": SENTENCES[1] + " ", "context_id": "b", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        await ws.send(json.dumps({"text": ""}))  # keep-alives change nothing, not even of a context
        await ws.send(json.dumps({"text": "", "context_id": "a"}))  # that is ending (Pipecat's)
        got, final_a = await read_until_final(ws, "a")
        await ws.send(json.dumps({"text": SENTENCES[2] + " ", "context_id": "b", "flush": True}))
        await ws.send(json.dumps({"close_socket": True}))
        more, final_b = await read_until_final(ws, "b")
        with pytest.raises(websockets.ConnectionClosedOK):
            await receive(ws)
    assert got["a"] == spoken_bytes(SENTENCES[0])
    assert got.get("b", 0) + more["b"] == spoken_bytes(SENTENCES[1], SENTENCES[2])
    assert final_a == final_b | {"contextId": "a"}
    assert final_b == {"isFinal": True, "contextId": "b", "ignored_fields": ["model_id", "sync_alignment"]}
    assert not any(wait_idle(server.url).values())


async def test_close_context_with_unflushed_text_stops_it_at_once(server):
    """Barge-in: the context's text was never flushed, so none of what is left is spoken."""
    before = aborted(server.url)
    async with connect(server, "multi-stream-input") as ws:
        await ws.send(json.dumps({"text": LONG + " And more is being writ", "context_id": "turn-1"}))
        first = await receive(ws)
        assert first["contextId"] == "turn-1" and first["audio"]
        assert engine_gauges(server.url)["running"] == 1  # still generating
        await ws.send(json.dumps({"context_id": "turn-1", "close_context": True}))
        got, final = await read_until_final(ws, "turn-1", timeout=10)
        assert got.get("turn-1", 0) < spoken_bytes(LONG) // 2
        assert not any(wait_idle(server.url).values()), "every stage freed its state"
        assert aborted(server.url) > before
        # the socket goes on: the next turn speaks in full
        await ws.send(json.dumps({"text": SENTENCES[0], "context_id": "turn-2", "flush": True}))
        await ws.send(json.dumps({"context_id": "turn-2", "close_context": True}))
        got, _ = await read_until_final(ws, "turn-2")
    assert got["turn-2"] == spoken_bytes(SENTENCES[0])


async def test_a_second_close_context_stops_a_context_still_finishing(server):
    """A context closed after its last flush speaks to its end; closing it again (an agent's
    barge-in after the reply was written) stops it now."""
    before = aborted(server.url)
    async with connect(server, "multi-stream-input") as ws:
        await ws.send(json.dumps({"text": LONG, "context_id": "reply", "flush": True}))
        await ws.send(json.dumps({"context_id": "reply", "close_context": True}))
        first = await receive(ws)
        assert first["audio"]
        await ws.send(json.dumps({"context_id": "reply", "close_context": True}))
        got, final = await read_until_final(ws, "reply", timeout=10)
    assert got.get("reply", 0) < spoken_bytes(LONG) // 2
    assert not any(wait_idle(server.url).values()), "every stage freed its state"
    assert aborted(server.url) > before


async def test_contexts_are_limited_and_errors_name_theirs(server):
    async with connect(server, "multi-stream-input") as ws:
        for context in ("one", "two"):
            await ws.send(json.dumps({"text": " ", "context_id": context}))
        await ws.send(json.dumps({"text": "Hello there.", "context_id": "three"}))
        error = await receive(ws)
        assert error["error"] == "too_many_contexts" and error["contextId"] == "three"
        await ws.send("{not json")
        assert (await receive(ws))["error"] == "invalid_input_message"
        await ws.send(json.dumps({"text": 5, "context_id": "one"}))
        assert (await receive(ws))["error"] == "invalid_input_message"
        await ws.send(json.dumps({"context_id": "one", "close_context": True}))
        await read_until_final(ws, "one")
        await ws.send(json.dumps({"text": SENTENCES[0], "context_id": "three", "flush": True}))
        message = await receive(ws)  # a place is free again
        assert message.get("contextId") == "three" and message["audio"]


@pytest.mark.parametrize("path,query,status,error", [
    ("stream-input", "output_format=flac_44100", 400, "invalid_output_format"),
    ("multi-stream-input", "output_format=pcm_16000&inactivity_timeout=999", 400, "invalid_request"),
])
async def test_a_bad_handshake_query_is_an_error_then_close(server, path, query, status, error):
    async with connect(server, path, query) as ws:
        message = await receive(ws)
        assert message["code"] == status and message["error"] == error, message
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await receive(ws)
        assert closed.value.rcvd.code == 1008


async def test_an_unknown_voice_is_an_error_then_close(server):
    ws_url = server.url.replace("http://", "ws://") + "/v1/text-to-speech/nobody-here/stream-input"
    async with websockets.connect(ws_url, additional_headers={"xi-api-key": KEY}) as ws:
        message = await receive(ws)
        assert message["error"] == "voice_not_found" and message["code"] == 404
        with pytest.raises(websockets.ConnectionClosed):
            await receive(ws)


async def test_a_quiet_socket_is_closed_after_its_inactivity_timeout(server):
    async with connect(server, "multi-stream-input", PCM + "&inactivity_timeout=2") as ws:
        for _ in range(3):  # keep-alives keep it open
            await asyncio.sleep(1)
            await ws.send(json.dumps({"text": ""}))
        message = await receive(ws, timeout=10)
        assert message["error"] == "input_timeout_exceeded" and "inactivity_timeout" in message["message"]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await receive(ws)
        assert closed.value.rcvd.code == 1008


async def test_a_client_gone_mid_stream_frees_every_stage(server):
    before = aborted(server.url)
    async with connect(server) as ws:
        await ws.send(json.dumps({"text": LONG, "flush": True}))
        assert (await receive(ws))["audio"]
    assert not any(wait_idle(server.url).values()), "every stage freed its state"
    assert aborted(server.url) > before
