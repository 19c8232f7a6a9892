"""``POST /v1/audio/speech/batch``: several speech requests in one call, answered as one JSON.

The body is ``{"items": [request, ...], ...defaults}``: 1 to ``api.max_batch_items`` speech
requests, and any other field of a speech request at the top level as a default for every item
(an item's own value wins), as vLLM-Omni has it. The items run concurrently through the engine,
each as its own request (admission, voices, encoding, metrics). The response lists, in the
items' order, each item's file (base64), its format and layout, finish reason and usage, the
fields the model ignored (`api.fields`), or the item's error in the OpenAI envelope with its HTTP
status. One bad item fails only itself; a body that is not a batch is a 400. A client that leaves
cancels every item still running. The items' files together hold at most
`api.max_batch_output_bytes` of audio: an item that would pass it fails with a 413 of its own (the
answer, base64 in JSON, is about 4/3 of that), and the answer is sent within `api.send_timeout_s`
a piece (`api.send_limits`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.errors import ApiError, bad_request, count_limit
from api.json_body import decode_json, read_json_body
from api.routes.speech import OutputCap, RequestTracker, new_tracker, outcome_of, start_speech, whole_file
from api.schemas import (ErrorDetail, SpeechBatchItem, SpeechBatchResponse, SpeechRequest,
                         speech_request_from)
from api.send_limits import Hold
from api.streaming import ClientGone, WholeAudioResponse, run_until_disconnect

log = logging.getLogger("mossvox.api")
_json = msgspec.json.Encoder()


async def create_speech_batch(request: Request) -> Response:
    state = request.state.api
    items, defaults = parse_batch(await read_json_body(request), max_items=state.profile.api.max_batch_items)
    limits = state.send_limits
    cap = OutputCap(state.profile.api.max_batch_output_bytes, "api.max_batch_output_bytes")
    holds = tuple(Hold(limits.held) for _ in items)
    try:
        results = await run_until_disconnect(
            asyncio.gather(*(_one(state, index, {**defaults, **item}, holds[index], cap)
                             for index, item in enumerate(items))),
            request.receive)
        succeeded = sum(1 for r in results if r.status == "success")
        body = _json.encode(SpeechBatchResponse(id=f"speech-batch-{uuid.uuid4().hex[:16]}", results=list(results),
                                                total=len(results), succeeded=succeeded,
                                                failed=len(results) - succeeded))
    except ClientGone:
        _release(holds)
        return Response(status_code=499)  # nobody is listening; every item's request was aborted
    except BaseException:
        _release(holds)
        raise
    return WholeAudioResponse(body, media_type="application/json", limits=limits, holds=holds,
                              headers={"X-Api-Process": str(os.getpid())})


def _release(holds: tuple[Hold, ...]) -> None:
    for hold in holds:
        hold.release()


def parse_batch(body: bytes, *, max_items: int) -> tuple[list[dict], dict]:
    """The items and the defaults of a batch body (400 when it is not one)."""
    doc = decode_json(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise bad_request('A batch is a JSON object with "items": a list of speech requests', param="items")
    items = doc.pop("items")
    if not 1 <= len(items) <= max_items:
        raise bad_request(f"A batch holds 1 to {max_items} items (api.max_batch_items); this one has "
                          f"{len(items)}", param="items")
    if "input" in doc:
        raise bad_request("input belongs to each item, not to the batch", param="input")
    if any(key in doc for key in ("stream", "stream_format")):
        raise bad_request("Batch items are returned whole: leave out stream and stream_format",
                          param="stream_format" if "stream_format" in doc else "stream")
    speech_request_from({**doc, "input": "-"})  # the defaults alone are valid (400 naming the field)
    bad = next((i for i, item in enumerate(items) if not isinstance(item, dict)), None)
    if bad is not None:
        raise bad_request(f"items[{bad}] is not an object", param=f"items[{bad}]")
    return items, doc


async def _one(state, index: int, fields: dict, hold: Hold, cap: OutputCap) -> SpeechBatchItem:
    tracker = new_tracker(state)
    try:
        req = speech_request_from(fields)
        if req.stream is not None or req.stream_format is not None:
            raise bad_request("Batch items are returned whole: leave out stream and stream_format",
                              param="stream_format" if req.stream_format is not None else "stream")
        started = await start_speech(req, state, tracker, receive=None, whole=True)
        audio = await whole_file(started, tracker, receive=None, hold=hold, cap=cap)
    except ApiError as exc:
        tracker.finish(outcome_of(exc), reason=f"{exc.status} {exc.message}")
        count_limit(state, exc)
        return _failed(index, exc)
    except Exception as exc:  # a bug: this item fails as a 500, the others carry on
        log.exception("%s: unexpected error in batch item %d", tracker.request_id, index)
        tracker.finish("failed")
        return _failed(index, ApiError(500, f"Internal server error ({type(exc).__name__})"))
    except BaseException:
        tracker.finish("cancelled")
        raise
    return _succeeded(index, req, started, tracker, audio)


def _succeeded(index: int, req: SpeechRequest, started, tracker: RequestTracker, audio: bytes) -> SpeechBatchItem:
    plan = started.plan
    return SpeechBatchItem(index=index, status="success", audio_data=base64.b64encode(audio).decode(),
                           media_type=started.encoder.content_type, response_format=plan.response_format,
                           sample_rate=plan.sample_rate, channels=plan.channels,
                           finish_reason=tracker.finish_reason or "stop", usage=tracker.usage(req.input),
                           **started.fields.event_fields())


def _failed(index: int, exc: ApiError) -> SpeechBatchItem:
    body = exc.body()["error"]
    return SpeechBatchItem(index=index, status="error", status_code=exc.status, error=ErrorDetail(**body))
