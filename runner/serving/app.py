"""The OpenAI-compatible server's app factory: its settings as one dataclass, the serving classes built once and
kept in the app's state, the routers (routers.py), API-key and CORS middleware, and OpenAI-style error objects for
every error, so a request that fails never disturbs the others."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runner.core.async_engine import AsyncEngine
from runner.serving import DEFAULT_MAX_BODY_BYTES
from runner.serving.protocol import APIError, error_response
from runner.serving.routers import ROUTERS
from runner.serving.serving_chat import ServingChat
from runner.serving.serving_completions import ServingCompletions
from runner.serving.serving_responses import ServingResponses
from runner.serving.serving_tokenization import ServingTokenization
from runner.serving.tool_parsers import PARSERS

OPEN_PATHS = ("/health", "/metrics", "/version")  # probes and scrapers need no API key


# threads that prepare requests with a structured output: grammars compile one at a time, but a grammar compiled
# before is ready at once, so a few threads let such requests pass one that compiles
STRUCTURED_OUTPUT_THREADS = 4


@dataclass(frozen=True)
class ServerConfig:
    """`api_key`: when set, every route but OPEN_PATHS wants `Authorization: Bearer <api_key>` (401 otherwise).
    `tool_call_parser` (a name in runner/serving/tool_parsers.PARSERS): read the calls the model makes by itself,
    which serves tool_choice "auto". `allowed_origins`: the browser origins (CORS) that may call the API ("*": any).
    `shutdown_grace`: seconds running requests get to finish when the server stops. `max_body_bytes`: the largest
    request body taken (413 otherwise, before the body is read whole). `special_tokens_in_content`: read
    special-token text inside message content as those tokens (vLLM's and transformers' behaviour) rather than as
    plain text (the default: a client cannot forge another role's turn)."""

    model_name: str
    shutdown_grace: float = 10.0
    api_key: str | None = None
    tool_call_parser: str | None = None
    allowed_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    special_tokens_in_content: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; known: {', '.join(PARSERS)}")


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    # requests with a structured output are prepared here, apart from the others (ServingContext.prepare)
    structured_pool = ThreadPoolExecutor(STRUCTURED_OUTPUT_THREADS, thread_name_prefix="structured-outputs")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # on shutdown: no new requests, running ones get `shutdown_grace` seconds, then are aborted
        await asyncio.to_thread(engine.shutdown, config.shutdown_grace)
        structured_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llm-engine-builder runner", version="0.1.0", lifespan=lifespan)
    parser = None if config.tool_call_parser is None else PARSERS[config.tool_call_parser]
    state = app.state
    state.engine, state.model_name = engine, config.model_name
    serving = (engine, config.model_name, parser, config.special_tokens_in_content, structured_pool)
    state.completions = ServingCompletions(*serving)
    state.chat = ServingChat(*serving)
    state.responses = ServingResponses(*serving)
    state.tokenization = ServingTokenization(*serving)
    for router in ROUTERS:
        app.include_router(router)
    _add_error_handlers(app)
    if config.api_key is not None:
        _require_api_key(app, config.api_key)
    if config.allowed_origins:  # a browser's preflight is answered before the key check
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)  # added last, so outermost: before anything reads
    return app


RELEASE_AFTER_BYTES = 2**20


def _glibc(function: str, *args) -> None:
    """Calls one of glibc's allocator controls; nothing where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        getattr(ctypes.CDLL("libc.so.6"), function)(*args)


def release_free_heap() -> None:
    """Returns the heap's free pages to the system (glibc's malloc_trim), which glibc otherwise keeps after a large
    body's strings are freed, so the server's RSS comes back after large requests; nothing where there is no
    glibc."""
    _glibc("malloc_trim", 0)


M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own heap arena (up to 8 per core), and a free page kept in one
    arena serves no other: with the worker threads that parse and template bodies, the server's RSS grows with
    every thread that once handled a large request. A few shared arenas keep it near what is in use. For the
    server process (`runner serve`); nothing where there is no glibc."""
    _glibc("mallopt", M_ARENA_MAX, arenas)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuses a request body over `max_bytes` with a 413 before it is read whole: at once where Content-Length says
    so, else as soon as the body received passes the limit (a chunked upload)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, declared.isdigit())
        received, exceeded = 0, False

        async def counted_receive():
            nonlocal received, exceeded
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                exceeded = True
                raise BodyTooLarge
            return message

        async def guarded_send(message):
            if not exceeded:  # once the body overflowed, whatever the app made of it gives way to the 413
                await send(message)

        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, counted_receive, guarded_send)
        if exceeded:
            await self._refuse(scope, receive, send, True)
        if received > RELEASE_AFTER_BYTES:  # its parsed copies are garbage now: give their pages back
            await asyncio.to_thread(release_free_heap)

    async def _refuse(self, scope, receive, send, length_known: bool) -> None:
        message = (
            f"the request body is larger than this server takes ({self.max_bytes} bytes)"
            if length_known
            else "the Content-Length header is not a number"
        )
        await error_response(413 if length_known else 400, message, "invalid_request_error")(scope, receive, send)


def _require_api_key(app: FastAPI, api_key: str) -> None:
    expected = api_key.encode()

    @app.middleware("http")
    async def check_api_key(http: Request, call_next):
        scheme, _, given = http.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
        valid = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)
        if http.url.path not in OPEN_PATHS and not valid:
            response = error_response(
                401, "invalid or missing API key (Authorization: Bearer ...)", "invalid_request_error"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await call_next(http)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.kind, err.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return error_response(
                400, f"malformed JSON body: {first.get('ctx', {}).get('error', 'invalid')}", "invalid_request_error"
            )
        message = f"{where}: {first.get('msg', 'invalid')}" if where else first.get("msg", "invalid")
        return error_response(400, message, "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods get OpenAI error objects too (not FastAPI's {"detail": ...})."""
        return error_response(
            err.status_code, f"{err.detail}", "invalid_request_error" if err.status_code < 500 else "server_error"
        )
