"""The OpenAI-compatible HTTP API over one target (docs/serve.md).

``create_app`` wires the routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions``, ``GET /health``, ``GET /metrics``. The API key is checked before the body
is read (:class:`_ApiKey`), oversized bodies are refused unread (:class:`_BodyLimit`); a request
is then checked and tokenized off the event loop, on a thread of its own
(:func:`specwise.serve.requests.prepare`, :mod:`specwise.serve.own_thread`), queued
for the one :class:`~specwise.serve.worker.GenerationWorker`, and answered as JSON or as
Server-Sent Events (:mod:`specwise.serve.responses`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.sse import EventSourceResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specwise.serve.metrics import ServerMetrics
from specwise.serve.own_thread import in_own_thread
from specwise.serve.page import page_html
from specwise.serve.protocol import ApiError, ChatRequest, CompletionRequest, now
from specwise.serve.requests import Limits, prepare
from specwise.serve.responses import completion_body, record_finished, stream_events
from specwise.serve.worker import GenerationWorker, Job

log = logging.getLogger("specwise.serve")

#: how often a non-streaming request checks whether its client is still there (s)
_DISCONNECT_POLL_S = 0.1


@dataclass(frozen=True)
class ServerConfig:
    """What a server serves and its limits.

    Attributes:
        model: the model id clients name (``/v1/models``).
        default_method: the method of a request that names none.
        methods: the methods a request may choose (``speculative.method``); ``default_method`` first.
        api_key: required as ``Authorization: Bearer KEY`` on ``/v1/*`` when set; several keys
            (a tuple) are several tenants, each drafting only from its own requests' text
            (:func:`tenant_of`).
        max_queue: requests that may wait behind the running ones; beyond, 503 with ``Retry-After``.
        max_batch: generations running at once where the target batches them (the llama.cpp
            engine); 1 runs one at a time, as the torch engine always does (docs/serve.md).
        max_tokens_cap: the most new tokens a request may ask for (and the default for chat).
        max_prompt_tokens: the longest prompt accepted (413 beyond); ``None``: the target's context.
        max_messages: the most chat messages in one request (413 beyond).
        max_body_bytes: the largest request body (413 beyond).
        time_limit_s: seconds a generation may run before it is stopped (504).
        default_options: options of the default method's drafter (``--option``).
        draft_budget: how a generation run alone sizes its drafts (``generate``'s ``draft_budget``);
            one in a batch follows the batch's cost model.
    """

    model: str
    default_method: str = "ar"
    methods: tuple[str, ...] = ("ar",)
    api_key: str | tuple[str, ...] | None = None
    max_queue: int = 64
    max_batch: int = 8
    max_tokens_cap: int = 2048
    max_prompt_tokens: int | None = None
    max_messages: int = 256
    max_body_bytes: int = 1 << 20
    time_limit_s: float = 600.0
    default_options: dict = field(default_factory=dict)
    draft_budget: str = "measured"

    @property
    def limits(self) -> Limits:
        """What each request is checked against."""
        methods = tuple(dict.fromkeys([self.default_method, *self.methods]))
        return Limits(self.model, self.default_method, methods, self.max_tokens_cap, self.max_prompt_tokens,
                      self.max_messages, self.draft_budget)


def create_app(target, config: ServerConfig, *, worker_thread: bool = True) -> FastAPI:
    """The app serving ``target``; builds the allowed methods' drafters.

    Args:
        worker_thread: run generations on a thread of the worker's own; ``False`` leaves
            ``app.state.worker.run()`` to the caller (``specwise serve`` runs it on the main thread).

    Raises:
        SpecwiseError: a method's drafter cannot be built for the target.
    """
    metrics = ServerMetrics()
    worker = GenerationWorker(target, list(config.limits.methods), config.max_queue, config.time_limit_s, metrics,
                              {config.default_method: dict(config.default_options)}, max_batch=config.max_batch)
    worker.start(thread=worker_thread)
    service = Service(target, config, worker, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="specwise", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    # the last added runs first: the API key is checked before any of the body is read
    app.add_middleware(_BodyLimit, max_body_size=config.max_body_bytes, metrics=metrics)
    app.add_middleware(_ApiKey, api_key=config.api_key, metrics=metrics)
    install_error_handlers(app, metrics)
    page = page_html(target, config.model, config.limits.methods, config.default_method, config.max_tokens_cap,
                     config.api_key is not None)
    app.get("/", response_class=HTMLResponse)(lambda: HTMLResponse(page))
    app.get("/health")(service.health)
    app.get("/metrics")(service.prometheus)
    app.get("/v1/models")(service.models)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await service.serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await service.serve(request, body, chat=True)

    return app


class Service:
    """What the routes do, over one target, its worker and its metrics."""

    def __init__(self, target, config: ServerConfig, worker: GenerationWorker, metrics: ServerMetrics) -> None:
        self.target, self.config, self.worker, self.metrics = target, config, worker, metrics
        self.limits = config.limits
        self.started = now()

    async def health(self):
        self.metrics.requests.labels("/health", "200").inc()
        return {"status": "ok", "model": self.config.model, "waiting": self.worker.waiting,
                "running": self.worker.running}

    async def prometheus(self):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self):
        self.metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": self.config.model, "object": "model", "created": self.started,
                                            "owned_by": "specwise"}]}

    async def serve(self, request: Request, body, chat: bool):
        """Check, queue and answer one completion request (streamed or not).

        Raises:
            ApiError: the request is refused (answered by the error handlers).
        """
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        tenant = request.scope.get("state", {}).get(TENANT, "")
        prepared = await in_own_thread(prepare, self.target, body, chat, self.limits, tenant, self.worker.drafter)
        job = Job(prepared.request_id, prepared.request, deadline=float("inf"), loop=asyncio.get_running_loop(),
                  stream=body.stream, user=body.user, origins=bool(body.speculative and body.speculative.origins))
        self.worker.submit(job)
        if body.stream:
            self.metrics.requests.labels(endpoint, "200").inc()
            return EventSourceResponse(self._stream(job, body, chat, prepared.prompt_tokens))
        try:
            result = await self._result(request, job)
        finally:
            self.worker.withdraw(job)  # a no-op once finished; frees the job if this handler was cancelled
        if result is None:
            return Response(status_code=499)
        record_finished(self.metrics, job, result, prepared.prompt_tokens)
        self.metrics.requests.labels(endpoint, "200").inc()
        return completion_body(job, result, self.config.model, chat, prepared.prompt_tokens, self._token_text)

    async def _result(self, request: Request, job: Job):
        """The job's result; ``None`` when its client went away first.

        Raises:
            ApiError: the generation ended with an error (time limit, shutdown, bad input).
        """
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    waiting = self.worker.withdraw(job)
                    log.info("%s cancelled%s: the client went away", job.id, " while waiting" if waiting else "")
                    return None
                continue
            if kind == "error":
                raise value
            return value

    def _token_text(self, token: int) -> tuple[str, bytes]:
        """One token's text, special tokens kept, and its own bytes (for log-probabilities): from the
        grammar engine's byte-level view of the vocabulary where the target has one (built at
        start), else the text's UTF-8 (which a token holding part of a character cannot give)."""
        text = self.target.decode([token], special_tokens=True)
        compiler = self.target.kept.once.peek("grammar_compiler")
        if compiler is None or not 0 <= token < compiler.real_tokens or compiler.tokenizer.is_special_token(token):
            return text, text.encode("utf-8")
        return text, compiler.tokenizer.decode_bytes([token])

    async def _stream(self, job: Job, body, chat: bool, prompt_tokens: int):
        done = False
        try:
            async for event in stream_events(job, body, chat, self.config.model, prompt_tokens,
                                             lambda result: record_finished(self.metrics, job, result, prompt_tokens),
                                             self._token_text):
                yield event
            done = True
        finally:
            waiting = self.worker.withdraw(job)
            if not done:
                log.info("%s cancelled: the client went away %s", job.id, "while waiting" if waiting else "mid-stream")


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every refusal as OpenAI's error JSON, one sentence, counted by endpoint and status."""

    def endpoint_of(request: Request) -> str:
        return request.url.path if request.url.path in _ENDPOINTS else "other"

    def answer(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(endpoint_of(request), str(exc.status)).inc()
        log.info("%s %s refused: %d param=%s %s", request.method, request.url.path, exc.status, exc.param or "-",
                 exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if "json" not in request.headers.get("content-type", ""):
            return answer(request, ApiError(400, "send the request body as JSON with the header "
                                                 "'Content-Type: application/json'."))
        return answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions.",
                   405: f"{request.method} is not allowed on {request.url.path}."}
        return answer(request, ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                                        kind="invalid_request_error" if exc.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return answer(request, ApiError(500, "the server failed on this request; see its log.", kind="server_error"))


_ENDPOINTS = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


#: the request scope's ``state`` entry naming the request's tenant (:func:`tenant_of`)
TENANT = "specwise.tenant"


def tenant_of(key: str) -> str:
    """The tenant an API key stands for: a digest of the key (never the key itself, which then
    appears in no drafter option, log or metric)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class _ApiKey:
    """401 with OpenAI's error JSON on ``/v1/*`` without a right ``Authorization: Bearer KEY``,
    decided from the headers alone, before the body is read or checked; the key's tenant
    (:func:`tenant_of`) is put in the request's state."""

    def __init__(self, app, api_key: str | tuple[str, ...] | None, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.api_keys = (api_key,) if isinstance(api_key, str) else api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.api_keys is None or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        given = key.strip().encode()
        # every key compared, so the time taken does not tell which keys a guess came close to
        right = [secrets.compare_digest(given, known.encode()) for known in self.api_keys]
        if scheme.lower() == "bearer" and any(right):
            scope.setdefault("state", {})[TENANT] = tenant_of(key.strip())
            return await self.app(scope, receive, send)
        error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'.",
                         kind="authentication_error")
        path = scope.get("path", "")
        self.metrics.requests.labels(path if path in _ENDPOINTS else "other", "401").inc()
        await JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


class _BodyLimit:
    """413 with OpenAI's error JSON for a request body over the limit: refused on its declared
    ``Content-Length`` before it is read, or once a chunked body grows past it (read up to the limit,
    then handed to the app)."""

    def __init__(self, app, max_body_size: int, metrics: ServerMetrics) -> None:
        self.app, self.max_body_size, self.metrics = app, max_body_size, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit():
            if int(declared) > self.max_body_size:
                return await self._refuse(scope, receive, send, f"{int(declared)} bytes")
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_size:
                return await self._refuse(scope, receive, send, f"over {self.max_body_size} bytes")
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send, size: str) -> None:
        error = ApiError(413, f"the request body has {size}; this server accepts at most {self.max_body_size}.")
        path = scope.get("path", "")
        self.metrics.requests.labels(path if path in _ENDPOINTS else "other", "413").inc()
        await JSONResponse(error.body(), status_code=413)(scope, receive, send)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first pydantic error as one sentence naming the field."""
    error = exc.errors()[0]
    kind = error.get("type", "")
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    if kind == "json_invalid" or not loc and kind in ("model_attributes_type", "dict_type"):
        return ApiError(400, "the request body is not a valid JSON object.")
    param = _param(loc)
    if param == "prompt" and kind != "value_error":
        return ApiError(400, "prompt must be a text, a list of token ids, or a list of one text.", param)
    if kind == "missing":
        return ApiError(400, f"missing required parameter {param!r}.", param)
    if kind == "extra_forbidden":
        return ApiError(400, f"unsupported parameter {param!r}: this server does not implement it.", param)
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return ApiError(400, f"invalid {param!r}: {message}.", param)


def _param(loc: list[str]) -> str:
    """``messages.0.role`` from a pydantic location, union member names (``str``, ``list[int]``) dropped."""
    kept = []
    for part in loc:
        if "[" in part or part in ("str", "int", "float", "bool") or part.startswith(("function-", "literal")):
            break
        kept.append(part)
    return ".".join(kept) or "body"
