"""The ASGI application (Starlette): OpenAI-compatible routes (the Responses
API among them) and Anthropic's Messages API.

Starlette rather than FastAPI: the request and response schemas are msgspec
Structs decoded and encoded by hand, so FastAPI's pydantic validation and
dependency injection would only add per-request overhead; the few routes fit
Starlette's routing directly.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ferrox.common.runtime import __version__
from ferrox.server import openai_protocol as op
from ferrox.server.anthropic_messages import AnthropicServing
from ferrox.server.error_responses import (
    anthropic_error_response,
    error_response,
    exception_response,
    is_anthropic_path,
)
from ferrox.server.lora_adapters import AdapterRoutes
from ferrox.server.middleware import GuardMiddleware
from ferrox.server.pooling import PoolingServing
from ferrox.server.responses_api import ResponsesServing
from ferrox.server.serving import OpenAIServing, ServingContext

RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


def _json(value: msgspec.Struct | dict) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


@dataclass(frozen=True)
class CorsOptions:
    """Cross-origin access, as vLLM's --allowed-* flags give it."""

    origins: list[str] = field(default_factory=lambda: ["*"])
    methods: list[str] = field(default_factory=lambda: ["*"])
    headers: list[str] = field(default_factory=lambda: ["*"])
    credentials: bool = False


def build_app(
    ctx: ServingContext,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 8 << 20,
    lifespan: object = None,
    cors: CorsOptions | None = None,
    profiling: bool = False,
) -> Starlette:
    serving = OpenAIServing(ctx)
    anthropic = AnthropicServing(serving)
    responses = ResponsesServing(serving)
    pooling = PoolingServing(serving)

    async def health(_: Request) -> Response:
        if ctx.client.is_dead:
            return error_response(503, f"the engine stopped: {ctx.client.dead_message}")
        if ctx.client.is_stalled:
            silent = time.monotonic() - ctx.client.last_message_at
            return error_response(503, f"the engine has made no progress for {silent:.0f} s")
        if ctx.draining:
            return error_response(503, "the server is shutting down", code="draining")
        return Response(status_code=200)

    def control(action: Callable[[], None]) -> Callable[[Request], Awaitable[Response]]:
        """A route that sends the engine one control message."""

        async def route(_: Request) -> Response:
            try:
                action()
            except Exception as e:
                return exception_response(e)
            return Response(status_code=200)

        return route

    async def version(_: Request) -> Response:
        return _json({"version": __version__})

    def card(name: str) -> op.ModelCard:
        return op.ModelCard(id=name, max_model_len=ctx.max_model_len)

    def adapter_card(name: str) -> op.ModelCard:
        lora = ctx.adapters.by_name[name]
        parent = lora.base_model_name or ctx.model_name
        return op.ModelCard(
            id=name, max_model_len=ctx.max_model_len, root=lora.lora_path, parent=parent
        )

    async def models(_: Request) -> Response:
        cards = [card(name) for name in ctx.model_names]
        cards += [adapter_card(name) for name in ctx.adapters.by_name]
        return _json(op.ModelList(data=cards))

    async def model(http: Request) -> Response:
        """One model by its id (ids may hold "/": `models.retrieve`)."""
        name = http.path_params["model"]
        if (missing := serving.check_model(name)) is not None:
            return missing
        return _json(adapter_card(name) if name in ctx.adapters.by_name else card(name))

    lora = AdapterRoutes(
        ctx.adapters, serving.decode, ctx.client.adapter_users, ctx.client.unload_adapter
    )

    async def metrics(_: Request) -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    async def tokenize(http: Request) -> Response:
        try:
            req = serving.decode(await http.body(), op.TokenizeRequest)
            if (missing := serving.check_model(req.model)) is not None:
                return missing
            if req.messages is not None:
                tokens = (await serving.chat_prompt_async(req)).ids
            else:
                text = req.prompt or ""
                encode = ctx.tokenizer.encode
                ids = await serving.offload(
                    len(text), lambda: encode(text, add_special_tokens=req.add_special_tokens)
                )
                tokens = list(ids)
            return _json(
                op.TokenizeResponse(
                    tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len
                )
            )
        except Exception as e:
            return exception_response(e)

    async def detokenize(http: Request) -> Response:
        try:
            req = serving.decode(await http.body(), op.DetokenizeRequest)
            if (missing := serving.check_model(req.model)) is not None:
                return missing
            text = await serving.offload(
                len(req.tokens), lambda: serving.detokenize(req.tokens, param="tokens")
            )
            return _json(op.DetokenizeResponse(prompt=text))
        except Exception as e:
            return exception_response(e)

    async def http_error(http: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if is_anthropic_path(http.url.path):
            message = {404: "no such route", 405: "method not allowed for this route"}
            return anthropic_error_response(
                exc.status_code, message.get(exc.status_code, str(exc.detail))
            )
        if exc.status_code == 404:
            return error_response(404, "no such route", code="not_found")
        if exc.status_code == 405:
            return error_response(405, "method not allowed for this route")
        return error_response(exc.status_code, str(exc.detail))

    async def server_error(_: Request, exc: Exception) -> Response:
        return exception_response(exc)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/reset_prefix_cache", control(ctx.client.reset_prefix_cache), methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/load_lora_adapter", lora.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", lora.unload, methods=["POST"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/chat/completions", serving.chat, methods=["POST"]),
        Route("/v1/embeddings", pooling.embeddings, methods=["POST"]),
        Route("/v1/classify", pooling.classify, methods=["POST"]),
        Route("/v1/score", pooling.score, methods=["POST"]),
        *(Route(path, pooling.rerank, methods=["POST"]) for path in RERANK_PATHS),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
    ]
    if profiling:
        routes += [
            Route("/start_profile", control(ctx.client.start_profile), methods=["POST"]),
            Route("/stop_profile", control(ctx.client.stop_profile), methods=["POST"]),
        ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,  # type: ignore[arg-type]
    )
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    cors = cors or CorsOptions()
    # Added last, so outermost: a preflight is answered before the API-key check.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.origins,
        allow_methods=cors.methods,
        allow_headers=cors.headers,
        allow_credentials=cors.credentials,
    )
    return app


__all__ = ["JSONResponse", "build_app"]
