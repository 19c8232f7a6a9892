"""``GET /metrics``: Prometheus exposition (all API processes + engine counters)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from api.metrics import CONTENT_TYPE


async def metrics(request: Request) -> Response:
    body = await asyncio.to_thread(request.state.api.metrics.render)
    return Response(body, media_type=CONTENT_TYPE)
