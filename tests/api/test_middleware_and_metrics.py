"""Bearer auth, body limit and metrics rendering, on a small real Starlette app."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from api.auth import BearerAuthMiddleware
from api.errors import EXCEPTION_HANDLERS
from api.limits import BodyLimitMiddleware
from api.metrics import ApiMetrics


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"bytes": len(await request.body())})


def make_app(keys=("k1", "k2"), max_bytes=1024) -> Starlette:
    routes = [Route("/v1/echo", echo, methods=["POST"]), Route("/health", echo, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, middleware=[
        Middleware(BodyLimitMiddleware, max_bytes=max_bytes), Middleware(BearerAuthMiddleware, keys=keys)])


@pytest.fixture
async def client():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app()), base_url="http://t") as c:
        yield c


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic k1", "Bearer ", "k1"])
async def test_missing_or_wrong_key_is_401_envelope(client, header):
    r = await client.post("/v1/echo", content=b"x", headers={"Authorization": header} if header else {})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["message"] and set(err) == {"message", "type", "param", "code"}


async def test_any_configured_key_passes_and_open_routes_need_none(client):
    for key in ("k1", "k2"):
        assert (await client.post("/v1/echo", content=b"abc", headers={"Authorization": f"Bearer {key}"})).json() == {"bytes": 3}
    assert (await client.post("/health", content=b"")).status_code == 200


async def test_no_keys_means_no_auth():
    app = make_app(keys=())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.post("/v1/echo", content=b"ab")).status_code == 200


async def test_body_over_limit_is_413_declared_or_streamed(client):
    auth = {"Authorization": "Bearer k1"}
    r = await client.post("/v1/echo", content=b"x" * 2000, headers=auth)
    assert r.status_code == 413 and "1024" in r.json()["error"]["message"]

    async def chunked():
        for _ in range(5):
            yield b"y" * 500

    r = await client.post("/v1/echo", content=chunked(), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert (await client.post("/v1/echo", content=b"x" * 1024, headers=auth)).status_code == 200


async def test_unknown_route_is_404_envelope(client):
    r = await client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_metrics_render_request_figures_and_engine_counters():
    counters = {"running": 2, "queued": 1, "talker_slots": 3, "codec_slots": 2, "aborted": 5,
                "codec_batch_sizes": {1: 4, 4: 2}}
    metrics = ApiMetrics(engine_counters=lambda: counters)
    metrics.requests.labels(outcome="ok").inc()
    metrics.ttfa.observe(0.05)
    metrics.ref_cache.labels(result="hit").inc(2)
    text = metrics.render().decode()
    assert 'mossvox_requests_total{outcome="ok"} 1.0' in text
    assert "mossvox_time_to_first_audio_seconds_count 1.0" in text
    assert 'mossvox_ref_cache_lookups_total{result="hit"} 2.0' in text
    assert "mossvox_engine_running 2.0" in text and "mossvox_engine_queued 1.0" in text
    assert "mossvox_engine_talker_slots 3.0" in text and "mossvox_engine_aborted_total 5.0" in text
    assert 'mossvox_engine_codec_batch_sizes_bucket{le="4"} 6.0' in text
    assert "mossvox_engine_codec_batch_sizes_sum 12.0" in text


def test_metrics_still_render_when_the_engine_is_down():
    def broken():
        raise RuntimeError("engine gone")

    assert "mossvox_engine_up 0.0" in ApiMetrics(engine_counters=broken).render().decode()
