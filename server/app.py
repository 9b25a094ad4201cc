"""The FastAPI app: routes, auth, errors, metrics.

`build_app(client, ...)` takes a started engine client (anything with the
`AsyncEngineClient` surface) and returns the ASGI app; `server.cli` owns the
process (start the engine, bind the socket, run uvicorn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from importlib import metadata
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server.errors import APIError, engine_dead, error_responses, install_error_handlers
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from server.serving_chat import ChatHandler, messages_for_template, render_chat
from server.logprobs import TokenText
from server.serving_common import Admission, ServingState
from server.serving_completions import CompletionHandler
from server.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser

logger = logging.getLogger("serval.server")


def serval_version() -> str:
    try:
        return metadata.version("serval")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def _stream_doc(chunk_model: type) -> dict[int | str, dict[str, Any]]:
    """OpenAPI: the 200 is JSON, or with "stream": true an SSE stream of chunks."""
    return {
        200: {
            "description": "The completion; with `\"stream\": true`, a `text/event-stream` of "
            f"`data: <{chunk_model.__name__}>` events ending with `data: [DONE]`.",
            "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk_model.__name__}"}}},
        }
    }


def build_app(
    client: Any,
    *,
    served_model_name: str,
    model_root: str | None = None,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    tool_call_parser: str = DEFAULT_TOOL_PARSER,
) -> FastAPI:
    limit = None if max_queued_requests is None else client.info.max_num_seqs + max_queued_requests
    metrics = ServerMetrics(served_model_name, lambda: client.latest_stats)
    state = ServingState(
        client=client,
        served_model_name=served_model_name,
        metrics=metrics,
        admission=Admission(limit),
        token_text=TokenText(client.tokenizer),
        tool_parser=get_tool_parser(tool_call_parser),
    )
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        watch = asyncio.create_task(_watch_engine(client))
        try:
            yield
        finally:
            watch.cancel()

    app = FastAPI(
        title="Serval",
        version=serval_version(),
        description="OpenAI-compatible LLM inference server.",
        lifespan=lifespan,
    )
    app.state.serving = state
    install_error_handlers(app)

    bearer = HTTPBearer(auto_error=False, description="The key given with --api-key / SERVAL_API_KEY.")

    async def check_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if api_key is None:
            return
        if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), api_key.encode()):
            raise APIError(
                "Incorrect or missing API key. Send it as `Authorization: Bearer <key>`.",
                status=401,
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    auth = [Depends(check_key)] if api_key is not None else []
    chat = ChatHandler(state)
    completions = CompletionHandler(state)

    @app.post(
        "/v1/chat/completions",
        tags=["openai"],
        response_model=ChatCompletionResponse,
        responses={**_stream_doc(ChatCompletionChunk), **error_responses(400, 401, 404, 429, 503)},
        dependencies=auth,
    )
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat(req, raw)

    @app.post(
        "/v1/completions",
        tags=["openai"],
        response_model=CompletionResponse,
        responses={**_stream_doc(CompletionStreamResponse), **error_responses(400, 401, 404, 429, 503)},
        dependencies=auth,
    )
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await completions(req, raw)

    def model_card() -> ModelCard:
        return ModelCard(id=served_model_name, created=created, root=model_root,
                         max_model_len=client.info.max_model_len)

    @app.get("/v1/models", tags=["openai"], response_model=ModelList, responses=error_responses(401),
             dependencies=auth)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model:path}", tags=["openai"], response_model=ModelCard,
             responses=error_responses(401, 404), dependencies=auth)
    async def retrieve_model(model: str) -> ModelCard:
        state.check_model(model)
        return model_card()

    @app.post("/tokenize", tags=["serval"], response_model=TokenizeResponse,
              responses=error_responses(400, 401, 404), dependencies=auth)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        state.check_model(req.model)
        tok = client.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError("Give exactly one of `prompt` or `messages`.", param="prompt")
        if req.messages is not None:
            _, ids = render_chat(tok, messages_for_template(req.messages), req.add_generation_prompt)
        else:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = list(tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=client.info.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", tags=["serval"], response_model=DetokenizeResponse,
              responses=error_responses(400, 401, 404), dependencies=auth)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(req.model)
        vocab = client.info.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens has token id {bad}, out of range [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=client.tokenizer.decode(req.tokens))

    @app.get("/health", tags=["serval"], response_model=HealthResponse, responses=error_responses(503))
    async def health() -> HealthResponse:
        if not client.is_healthy():
            raise engine_dead()
        return HealthResponse()

    @app.get("/metrics", tags=["serval"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text format"}})
    async def prometheus_metrics() -> Response:
        return Response(content=metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", tags=["serval"], response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=serval_version())

    def openapi() -> dict[str, Any]:
        # The stream chunk models are named by the routes' text/event-stream
        # responses but are no route's response_model, so add their schemas.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            # Validation errors are answered 400 in the OpenAI shape, never 422.
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            for model in (ChatCompletionChunk, CompletionStreamResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


async def _watch_engine(client: Any, period: float = 0.5) -> None:
    """Log once when the engine-core process dies (generate() calls already
    fail with EngineDeadError; /health answers 503 from then on)."""
    while client.is_healthy():
        await asyncio.sleep(period)
    logger.error("the engine-core process has died; /health now answers 503 and requests fail with 503")

