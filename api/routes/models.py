"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves, under each
name a request may use (the served name first, then the checkpoint's and the aliases), in
OpenAI's shapes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from api.fields import used_http_fields
from api.routes.voices import json_response
from api.schemas import ModelCard, ModelList
from api.speech_job import model_not_found


def _card(state, name: str) -> ModelCard:
    client = state.client
    return ModelCard(id=name, created=int(state.started_at), sample_rate=client.sample_rate,
                     channels=client.channels, root=client.model_name,
                     request_fields=list(used_http_fields(client.variant)))


async def list_models(request: Request) -> Response:
    state = request.state.api
    return json_response(ModelList(data=[_card(state, name) for name in state.model_names]))


async def get_model(request: Request) -> Response:
    state = request.state.api
    name = request.path_params["model_id"]
    if name not in state.model_names:
        raise model_not_found(name, state.model_names)
    return json_response(_card(state, name))
