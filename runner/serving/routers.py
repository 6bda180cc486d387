"""The HTTP routes, one router per API family, each a thin map from a route onto a serving class that app.py puts
in the app's state: what a route adds is HTTP itself (the client's connection, SSE responses, the status 499 for a
client that left)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from runner.serving.protocol import ChatBody, CompletionBody, DetokenizeBody, ResponsesBody, TokenizeBody
from runner.serving.serving_chat import ServingChat
from runner.serving.serving_completions import ServingCompletions
from runner.serving.serving_responses import ServingResponses
from runner.serving.serving_tokenization import ServingTokenization


def http_answer(answer: dict | AsyncIterator[str] | None) -> dict | Response:
    if answer is None:
        return Response(status_code=499)  # the client left before the answer was complete
    if isinstance(answer, dict):
        return answer
    return StreamingResponse(answer, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# A body parsed on the event loop stalls every other request for as long as the parse takes (~10 ms a MiB)
OFF_LOOP_JSON_BYTES = 64 * 2**10


class OffLoopJSONRequest(Request):
    """A request whose JSON body, when large, is parsed in a worker thread (FastAPI reads bodies through `json`)."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = (
                await asyncio.to_thread(json.loads, body) if len(body) > OFF_LOOP_JSON_BYTES else json.loads(body)
            )
        return self._json


class OffLoopJSONRoute(APIRoute):
    """FastAPI's documented way to give routes a custom Request class."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return route_handler


service = APIRouter()  # health, metrics, version: probes and scrapers


@service.get("/health")
async def health(http: Request):
    """200 while the engine serves; 503 with the reason once it has failed for good (a tensor-parallel rank gone)."""
    fatal = http.app.state.engine.fatal
    if fatal is not None:
        return JSONResponse({"status": "error", "error": str(fatal)}, status_code=503)
    return {"status": "ok"}


@service.get("/metrics")
async def metrics(http: Request) -> Response:
    state = http.app.state
    return Response(state.engine.metrics.render(state.model_name), media_type="text/plain; version=0.0.4")


@service.get("/version")
async def version(http: Request) -> dict:
    return {"version": http.app.version}


models = APIRouter()


@models.get("/v1/models")
async def list_models(http: Request) -> dict:
    return {"object": "list", "data": [http.app.state.chat.model_card]}


@models.get("/v1/models/{name:path}")
async def retrieve_model(name: str, http: Request) -> dict:
    """OpenAI's retrieve-a-model (client.models.retrieve)."""
    http.app.state.chat.check_model(name)
    return http.app.state.chat.model_card


tokenization = APIRouter(route_class=OffLoopJSONRoute)


def _tokenization(http: Request) -> ServingTokenization:
    return http.app.state.tokenization


@tokenization.post("/tokenize")
async def tokenize(body: TokenizeBody, http: Request) -> dict:
    return await asyncio.to_thread(_tokenization(http).tokenize, body)  # templating and tokenizing: off the loop


@tokenization.post("/detokenize")
async def detokenize(body: DetokenizeBody, http: Request) -> dict:
    return _tokenization(http).detokenize(body)


completions = APIRouter(route_class=OffLoopJSONRoute)


@completions.post("/v1/completions")
async def create_completion(body: CompletionBody, http: Request):
    serving: ServingCompletions = http.app.state.completions
    return http_answer(await serving.create(body, http.is_disconnected))


chat = APIRouter(route_class=OffLoopJSONRoute)


@chat.post("/v1/chat/completions")
async def create_chat_completion(body: ChatBody, http: Request):
    serving: ServingChat = http.app.state.chat
    return http_answer(await serving.create(body, http.is_disconnected))


responses = APIRouter(route_class=OffLoopJSONRoute)


def _responses(http: Request) -> ServingResponses:
    return http.app.state.responses


@responses.post("/v1/responses")
async def create_response(body: ResponsesBody, http: Request):
    return http_answer(await _responses(http).create(body, http.is_disconnected))


@responses.get("/v1/responses/{response_id}")
async def get_response(response_id: str, http: Request) -> dict:
    return _responses(http).get(response_id)


@responses.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    http: Request,
    order: Literal["asc", "desc"] = "desc",
    limit: int = 20,
    after: str | None = None,
    before: str | None = None,
) -> dict:
    return _responses(http).input_items(response_id, order, limit, after, before)


@responses.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, http: Request) -> dict:
    return _responses(http).delete(response_id)


ROUTERS = (service, models, tokenization, completions, chat, responses)
