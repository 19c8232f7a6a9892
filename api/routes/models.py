"""``GET /v1/models``: the one model this server serves (OpenAI list shape)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from api.routes.voices import json_response
from api.schemas import ModelCard, ModelList


async def list_models(request: Request) -> Response:
    state = request.state.api
    card = ModelCard(id=state.served_name, created=int(state.started_at),
                     sample_rate=state.client.sample_rate, channels=state.client.channels)
    return json_response(ModelList(data=[card]))
