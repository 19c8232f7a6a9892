"""``/health`` (the process and engine are alive) and ``/ready`` (models loaded and warmed up)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse


async def health(request: Request) -> JSONResponse:
    healthy = request.state.api.client.healthy()
    return JSONResponse({"status": "ok" if healthy else "unhealthy"}, status_code=200 if healthy else 503)


async def ready(request: Request) -> JSONResponse:
    client = request.state.api.client
    if client.healthy() and client.ready():
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})
