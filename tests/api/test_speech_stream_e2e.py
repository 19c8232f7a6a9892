"""`WS /v1/audio/speech/stream` end to end: a real `mossvox serve` (tiny demo model, Local-v1.5,
cpu profile) and real WebSocket clients on loopback.

Text sent a few characters at a time speaks the same audio as one message; the first sentence is
heard before input.done; input.cancel stops the audio and frees every stage; one session speaks
several utterances; bad messages get an error frame and the session goes on; a client written
for vLLM-Omni's protocol works unchanged; the demo page's "type as you go" mode is heard before
Done. Random weights: the audio is noise, its length is forced from the text (cpu profile), and
the same seed gives the same audio. Realtime and the Delay family over the WebSocket:
`tests/api/test_variants_server.py`.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import pytest
import websockets

from tests.api.helpers import FRAMES_PER_CHAR, engine_gauges, metric, wait_idle
from tests.api.server_process import REPO, ServerProcess
from tests.api.stream_client import (SpokenSentence, Utterance, connect, next_event, read_utterance, send,
                                     speak, ws_url)

BYTES_PER_FRAME = 3840 * 2 * 2  # the model's 48 kHz stereo s16: 80 ms
TEXT = ("The first sentence is complete here. A second one follows, with a comma! "
        "And a third one ends the story.")
# the model's own layout (pcm is OpenAI's 24 kHz mono unless asked), so lengths are exact
CONFIG = {"response_format": "pcm", "sample_rate": 48000, "channels": 2, "seed": 11,
          "split_granularity": "sentence"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("data"), sets=(
        "stream.max_sessions=6", "stream.max_session_chars=2000", "stream.idle_timeout_s=20")).start()
    yield s
    s.stop()


def frames(text: str) -> int:
    return max(1, round(FRAMES_PER_CHAR * len(text)))


async def test_text_in_small_pieces_speaks_the_same_audio_as_one_message(server):
    async with connect(server.url) as ws:
        whole = await speak(ws, [TEXT], **CONFIG)
        rng = random.Random(5)
        pieces, at = [], 0
        while at < len(TEXT):
            size = rng.randint(1, 5)
            pieces.append(TEXT[at:at + size])
            at += size
        split = await speak(ws, pieces)  # the config is sticky
        alone = await speak(ws, ["A second one follows, with a comma!"])
    texts = [s.start["sentence_text"] for s in whole.sentences]
    assert texts == ["The first sentence is complete here.", "A second one follows, with a comma!",
                     "And a third one ends the story."]
    assert [s.start["sentence_text"] for s in split.sentences] == texts
    for a, b in zip(whole.sentences, split.sentences):
        assert len(a.audio) == frames(a.start["sentence_text"]) * BYTES_PER_FRAME
        assert a.audio == b.audio, "same sentence and seed: the same audio, however the text came"
        assert a.done["total_bytes"] == len(a.audio) and a.done["finish_reason"] == "stop"
    # Local-v1.5 continues the previous sentence's codes: the same sentence spoken first differs
    assert alone.sentences[0].audio != whole.sentences[1].audio
    assert len(alone.sentences[0].audio) == len(whole.sentences[1].audio)
    assert (whole.done["utterance_index"], split.done["utterance_index"]) == (0, 1)
    assert whole.done["total_sentences"] == split.done["total_sentences"] == 3


async def test_the_first_sentence_is_heard_before_input_done(server):
    async with connect(server.url) as ws:
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.text", text="This sentence is complete now. And this one is still bei")
        start = await next_event(ws, 30)
        assert start["type"] == "audio.start" and start["sentence_text"] == "This sentence is complete now."
        first = await next_event(ws, 30)
        assert isinstance(first, bytes)  # audio, and input.done not sent yet
        await send(ws, "input.text", text="ng written.")
        await send(ws, "input.done")
        got = await read_utterance(ws, into=Utterance([SpokenSentence(start, bytearray(first))]))
    assert [s.start["sentence_text"] for s in got.sentences] == [
        "This sentence is complete now.", "And this one is still being written."]
    assert got.done["total_sentences"] == 2


async def test_cancel_mid_sentence_ends_the_audio_and_frees_every_stage(server):
    long_text = "This sentence goes on and on " * 12 + "until it ends."  # ~30 s of audio
    async with connect(server.url) as ws:
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.text", text=long_text)
        await send(ws, "input.done")
        start = await next_event(ws)
        assert start["type"] == "audio.start"
        first = await next_event(ws)
        assert isinstance(first, bytes)
        assert engine_gauges(server.url)["running"] == 1  # still generating
        # utterance 1 starts receiving text while utterance 0 is spoken; the cancel ends both
        await send(ws, "input.text", text="Buffered text that is never spoken")
        await send(ws, "input.cancel")
        spoken = Utterance([SpokenSentence(start, bytearray(first))])
        after = await read_utterance(ws, until="speech.audio.cancelled", into=spoken)
        cancelled = after.events[-1]
        assert cancelled["utterance_index"] == 0 and cancelled["sentence_index"] == 0
        assert cancelled["dropped_chars"] == len("Buffered text that is never spoken")
        assert [e["type"] for e in after.events] == ["speech.audio.cancelled"]
        assert len(after.audio) < frames(long_text) * BYTES_PER_FRAME  # the sentence was cut short
        assert not any(wait_idle(server.url).values()), "every stage freed its state"
        # nothing more of the cancelled speech comes: the next event is the next utterance's
        again = await speak(ws, ["After the barge-in, a new answer."])
    assert [e["type"] for e in again.events][:1] == ["audio.start"]
    assert [s.start["utterance_index"] for s in again.sentences] == [2]
    assert len(again.audio) == frames("After the barge-in, a new answer.") * BYTES_PER_FRAME


async def test_two_utterances_in_one_session_and_session_close(server):
    async with connect(server.url) as ws:
        first = await speak(ws, ["One utterance, one sentence."], **CONFIG, stream_audio=False)
        second = await speak(ws, ["Then another one. ", "It has two sentences."])
        await send(ws, "input.text", text="Spoken before the close.")
        await send(ws, "session.close")
        last = await read_utterance(ws)
        with pytest.raises(websockets.ConnectionClosedOK):
            await next_event(ws)
    assert [s.start["utterance_index"] for s in first.sentences + second.sentences + last.sentences] == [0, 1, 1, 2]
    assert [s.start["sentence_index"] for s in second.sentences] == [0, 1]
    assert all(s.start["sample_rate"] == 48000 and s.start["channels"] == 2 for s in first.sentences)
    assert len(first.sentences[0].audio) == frames("One utterance, one sentence.") * BYTES_PER_FRAME
    assert last.done == {"type": "session.done", "utterance_index": 2, "total_sentences": 1}


async def test_bad_messages_get_an_error_frame_and_the_session_survives(server):
    async def expect_error(ws, code: str | None = None, contains: str = "") -> dict:
        event = await next_event(ws, 30)
        assert event["type"] == "error", event
        assert set(event["error"]) == {"message", "type", "param", "code"}
        assert event["message"] == event["error"]["message"] and contains in event["message"]
        if code is not None:
            assert event["error"]["code"] == code
        return event

    async with connect(server.url) as ws:
        await send(ws, "input.text", text="Too early.")
        await expect_error(ws, "no_session_config")
        await send(ws, "session.config", split_granularity="words")
        await expect_error(ws, contains="split_granularity")
        await send(ws, "session.config", temperature=99)
        await expect_error(ws, contains="temperature")
        await send(ws, "session.config", response_format="ogg")  # the valid values, and the field
        bad_format = await expect_error(ws, contains="expected one of: aac, flac, mp3, opus, pcm, wav")
        assert bad_format["error"]["param"] == "response_format"
        await send(ws, "session.config", model="other-model")
        assert (await expect_error(ws))["error"]["param"] == "model"
        await send(ws, "session.config", **CONFIG, ref_text="a transcript without any audio")
        await expect_error(ws, contains="ref_text")
        await send(ws, "session.config", **CONFIG)
        await send(ws, "input.speak", text="hello")
        await expect_error(ws, "unknown_message_type")
        await ws.send("{not json")
        await expect_error(ws, contains="JSON")
        await ws.send(b"\x00\x01")
        await expect_error(ws, contains="binary")
        await send(ws, "input.text", text="x" * 2001, event_id="too-long")
        event = await expect_error(ws, "session_text_limit")
        assert event["event_id"] == "too-long" and event["error"]["param"] == "text"
        await send(ws, "input.text", text="Still speaking ")
        await send(ws, "session.config", response_format="wav")
        await expect_error(ws, "session_busy")
        got = await speak(ws, ["after all of that."])
    assert [s.start["sentence_text"] for s in got.sentences] == ["Still speaking after all of that."]
    assert got.sentences[0].start["format"] == "pcm"  # the refused config changed nothing


async def test_sessions_are_limited_and_counted(server):
    before = httpx.get(server.url + "/metrics").text
    opened = []
    try:
        for _ in range(6):
            opened.append(await connect(server.url))
        assert metric(httpx.get(server.url + "/metrics").text, "mossvox_stream_sessions_open") == 6
        async with connect(server.url) as extra:
            event = await next_event(extra)
            assert event["error"]["code"] == "too_many_sessions"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await next_event(extra)
            assert closed.value.rcvd.code == 1013
    finally:
        for ws in opened:
            await ws.close()
    for _ in range(50):
        after = httpx.get(server.url + "/metrics").text
        if metric(after, "mossvox_stream_sessions_open") == 0:
            break
        await asyncio.sleep(0.1)
    assert metric(after, "mossvox_stream_sessions_open") == 0
    assert metric(after, "mossvox_stream_utterances_total") >= metric(before, "mossvox_stream_utterances_total")
    assert metric(after, "mossvox_stream_time_to_first_audio_seconds_count") >= 1


def test_a_vllm_omni_style_client_works_unchanged(server, tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "tests.api.vllm_omni_stream_client", "--url", ws_url(server.url),
         "--text", "Hi there. How are you today?", "--text", "A second utterance, same socket.",
         "--response-format", "pcm", "--stream-audio", "--split-granularity", "sentence",
         "--model", "mossvox", "--voice", "default", "--language", "English", "--seed", "2",
         "--simulate-stt", "--stt-delay", "0.01", "--output-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    saved = [json.loads(line) for line in run.stdout.splitlines()]
    assert [s["file"] for s in saved] == ["utterance_000_sentence_000.pcm",
                                         "utterance_001_sentence_000.pcm"]
    # "Hi there." is shorter than a sentence's minimum (stream.min_segment_chars): it joins the
    # next; pcm comes in OpenAI's 24 kHz mono s16, as vLLM-Omni's clients assume
    seconds = saved[0]["bytes"] / (24000 * 2)
    assert abs(seconds - frames("Hi there. How are you today?") * 0.08) < 0.01
    assert all(s["bytes"] == s["total_bytes"] == (out / s["file"]).stat().st_size and not s["error"]
               for s in saved)


def test_demo_page_type_as_you_go_in_headless_chromium(server, tmp_path):
    """Typed a character at a time into the page's "type as you go" box, the first sentence is
    heard (the page's player runs) before Done is pressed; Done speaks the rest."""
    from tests.api.cdp_pipe import Chromium, find_chromium

    binary = find_chromium()
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium) - demo page not exercised")
    browser = Chromium(binary)
    typed = "The page speaks this first sentence as it is typed. Then the rest"
    try:
        browser.open_page(server.url + "/")
        deadline = time.monotonic() + 30
        while browser.evaluate("document.readyState") != "complete" and time.monotonic() < deadline:
            time.sleep(0.1)
        browser.evaluate("""(() => { const text = %s; let i = 0; const box = document.getElementById('live');
            const next = () => { if (i >= text.length) return; box.value += text[i++];
                                 box.dispatchEvent(new Event('input')); setTimeout(next, 15); };
            next(); })()""" % json.dumps(typed))
        state = {}
        while time.monotonic() < deadline:
            state = json.loads(browser.evaluate("JSON.stringify(document.body.dataset)"))
            if state.get("liveState") == "error" or float(state.get("playerTime", 0)) > 0.3:
                break
            time.sleep(0.1)
        before_done = dict(state)
        browser.evaluate("document.getElementById('livedone').click()")
        while time.monotonic() < deadline:
            state = json.loads(browser.evaluate("JSON.stringify(document.body.dataset)"))
            if state.get("liveState") in ("done", "error"):
                break
            time.sleep(0.1)
        (tmp_path / "live.png").write_bytes(browser.screenshot())
    finally:
        browser.close()
    assert before_done.get("liveState") == "speaking", before_done
    assert int(before_done["liveBytes"]) > 0 and float(before_done["playerTime"]) > 0  # heard before Done
    assert state["liveState"] == "done" and int(state["liveSentences"]) == 2, state
