"""``GET /``: the demo page; ``GET /openapi.json``: the API description."""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response


async def index(request: Request) -> HTMLResponse:
    page = files("api").joinpath("static/index.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-store"})


async def openapi(request: Request) -> Response:
    return Response(request.state.api.openapi_json, media_type="application/json")
