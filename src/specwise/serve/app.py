"""The OpenAI-compatible HTTP API over one target (ARCHITECTURE.md §8).

``create_app`` returns a FastAPI app: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions``, ``GET /health``, ``GET /metrics``. A request is validated (400 with OpenAI's
error JSON on anything unsupported), tokenized off the event loop, queued for the one
:class:`~specwise.serve.worker.GenerationWorker`, and answered as JSON or as Server-Sent Events (one
chunk per committed step) with ``usage`` and a ``speculative_decoding`` summary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specwise.api import encode_prompt
from specwise.errors import SpecwiseError
from specwise.serve.metrics import ServerMetrics
from specwise.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    finish_reason,
    now,
    speculative_decoding,
    usage,
)
from specwise.serve.worker import GenerationWorker, Job, check_request_options

log = logging.getLogger("specwise.serve")

#: how often a non-streaming request checks whether its client is still there (s)
_DISCONNECT_POLL_S = 0.5


@dataclass(frozen=True)
class ServerConfig:
    """What a server serves and its limits.

    Attributes:
        model: the model id clients name (``/v1/models``).
        default_method: the method of a request that names none.
        methods: the methods a request may choose (``speculative.method``); ``default_method`` first.
        api_key: required as ``Authorization: Bearer KEY`` on ``/v1/*`` when set.
        max_queue: requests that may wait behind the running one; beyond, 503 with ``Retry-After``.
        max_tokens_cap: the most new tokens a request may ask for (and the default for chat).
        max_prompt_tokens: the longest prompt accepted (413 beyond); ``None``: the target's context.
        max_messages: the most chat messages in one request (413 beyond).
        max_body_bytes: the largest request body (413 beyond).
        time_limit_s: seconds a generation may run before it is stopped (504).
        default_options: options of the default method's drafter (``--option``).
    """

    model: str
    default_method: str = "ar"
    methods: tuple[str, ...] = ("ar",)
    api_key: str | None = None
    max_queue: int = 64
    max_tokens_cap: int = 2048
    max_prompt_tokens: int | None = None
    max_messages: int = 256
    max_body_bytes: int = 1 << 20
    time_limit_s: float = 600.0
    default_options: dict = field(default_factory=dict)


def create_app(target, config: ServerConfig, *, worker_thread: bool = True) -> FastAPI:
    """The app serving ``target``; builds the allowed methods' drafters.

    Args:
        worker_thread: run generations on a thread of the worker's own; ``False`` leaves
            ``app.state.worker.run()`` to the caller (``specwise serve`` runs it on the main thread).

    Raises:
        SpecwiseError: a method's drafter cannot be built for the target.
    """
    metrics = ServerMetrics()
    started = now()
    methods = list(dict.fromkeys([config.default_method, *config.methods]))
    worker = GenerationWorker(target, methods, config.max_queue, config.time_limit_s, metrics,
                              {config.default_method: dict(config.default_options)})
    worker.start(thread=worker_thread)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="specwise", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics, app.state.config = worker, metrics, config
    # the last added runs first: the API key is checked before any of the body is read
    app.add_middleware(_BodyLimit, max_body_size=config.max_body_bytes, metrics=metrics)
    app.add_middleware(_ApiKey, api_key=config.api_key, metrics=metrics)

    def endpoint_of(request: Request) -> str:
        return request.url.path if request.url.path in _ENDPOINTS else "other"

    def answer_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.requests.labels(endpoint_of(request), str(exc.status)).inc()
        log.info("%s %s refused: %d param=%s %s", request.method, request.url.path, exc.status, exc.param or "-",
                 exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return answer_error(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if "json" not in request.headers.get("content-type", ""):
            return answer_error(request, ApiError(400, "send the request body as JSON with the header "
                                                       "'Content-Type: application/json'."))
        return answer_error(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions.",
                   405: f"{request.method} is not allowed on {request.url.path}.",
                   }
        return answer_error(request, ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                                              kind="invalid_request_error" if exc.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return answer_error(request, ApiError(500, "the server failed on this request; see its log.",
                                              kind="server_error"))

    @app.get("/health")
    async def health():
        metrics.requests.labels("/health", "200").inc()
        return {"status": "ok", "model": config.model, "waiting": worker.waiting, "running": worker.running}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": config.model, "object": "model", "created": started,
                                            "owned_by": "specwise"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await serve(request, body, chat=True)

    async def serve(request: Request, body, chat: bool):
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        job, prompt_tokens = await prepare(body, chat)
        worker.submit(job)
        if body.stream:
            metrics.requests.labels(endpoint, "200").inc()
            return EventSourceResponse(stream(job, body, chat, prompt_tokens))
        result = None
        try:
            while result is None:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        waiting = worker.withdraw(job)
                        log.info("%s cancelled%s: the client went away", job.id, " while waiting" if waiting else "")
                        return Response(status_code=499)
                    continue
                if kind == "error":
                    raise value
                result = value
        finally:
            worker.withdraw(job)  # a no-op once finished; frees the job if this handler was cancelled
        finished(job, result, prompt_tokens)
        metrics.requests.labels(endpoint, "200").inc()
        text = "".join(job.pieces)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason(result)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(result)}
        return {"id": job.id, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": config.model, "choices": [choice], "usage": usage(prompt_tokens, result),
                "speculative_decoding": speculative_decoding(result.stats)}

    async def stream(job: Job, body, chat: bool, prompt_tokens: int):
        created, kind_name = now(), "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if body.include_usage else {}

        def chunk(choices: list) -> bytes:
            data = {"id": job.id, "object": kind_name, "created": created, "model": config.model,
                    "choices": choices, **extra}
            return format_sse_event(data_str=_json(data))

        def choice(text: str | None, reason: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

        done = False
        try:
            if chat:
                yield chunk([choice(None, None, role=True)])
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield chunk([choice(value, None)])
                elif kind == "error":
                    yield format_sse_event(data_str=_json(value.body()))
                    break
                else:
                    finished(job, value, prompt_tokens)
                    yield chunk([choice(None, finish_reason(value))])
                    if body.include_usage:
                        data = {"id": job.id, "object": kind_name, "created": created, "model": config.model,
                                "choices": [], "usage": usage(prompt_tokens, value),
                                "speculative_decoding": speculative_decoding(value.stats)}
                        yield format_sse_event(data_str=_json(data))
                    break
            yield format_sse_event(data_str="[DONE]")
            done = True
        finally:
            waiting = worker.withdraw(job)
            if not done:
                log.info("%s cancelled: the client went away %s", job.id, "while waiting" if waiting else "mid-stream")

    def finished(job: Job, result, prompt_tokens: int) -> None:
        end = time.monotonic()
        metrics.record_result(result)
        metrics.latency.observe(end - job.submitted)
        if job.first_token is not None:
            metrics.time_to_first_token.observe(job.first_token - job.submitted)
        stats = result.stats
        log.info("%s user=%s method=%s prompt_tokens=%d completion_tokens=%d tau=%.2f accepted_prediction=%d "
                 "latency_s=%.3f queued_s=%.3f finish=%s", job.id, job.user or "-", stats.method, prompt_tokens,
                 len(result.token_ids), stats.mean_accepted_length, stats.prediction_accepted_tokens,
                 end - job.submitted, (job.started or end) - job.submitted, finish_reason(result))

    async def prepare(body, chat: bool) -> tuple[Job, int]:
        """Check a request against what the server serves and its limits; tokenize it; make its job."""
        if body.model != config.model:
            raise ApiError(404, f"the model {body.model!r} is not served here; this server serves {config.model!r}.",
                           "model", kind="not_found_error")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options needs stream=true.", "stream_options")
        spec = body.speculative
        method = (spec.method if spec and spec.method else None) or config.default_method
        if method not in methods:
            raise ApiError(400, f"method {method!r} is not loaded on this server (loaded: {', '.join(methods)}).",
                           "speculative.method")
        options = dict(spec.options) if spec else {}
        check_request_options(method, options)
        prediction = body.prediction.text if body.prediction is not None else None
        if prediction is not None and not prediction.strip():
            raise ApiError(400, "the prediction is empty; leave it out or give the text the output should repeat.",
                           "prediction")
        kwargs = dict(temperature=float(body.temperature), top_p=float(body.top_p) or 1.0,
                      top_k=1 if body.top_p == 0 else 0,  # top_p -> 0 keeps only the most likely token
                      seed=body.seed, stop=body.stop_strings, prediction=prediction)
        try:
            if chat:
                if len(body.messages) > config.max_messages:
                    raise ApiError(413, f"{len(body.messages)} messages exceed this server's limit of "
                                        f"{config.max_messages}.", "messages")
                messages = [{"role": m.role, "content": m.text} for m in body.messages]
                prompt_ids = await asyncio.to_thread(target.encode_chat, messages)
                kwargs["messages"] = messages
            else:
                prompt_ids = await asyncio.to_thread(encode_prompt, target, body.prompt)
                kwargs["prompt"] = prompt_ids
        except SpecwiseError as exc:
            hint = " Send a text prompt to /v1/completions instead." if chat and "chat template" in str(exc) else ""
            raise ApiError(400, str(exc) + hint, "messages" if chat else "prompt") from None
        prompt_tokens = int(prompt_ids.numel())
        limit = config.max_prompt_tokens or target.max_context
        if prompt_tokens > limit:
            raise ApiError(413, f"the prompt has {prompt_tokens} tokens; this server accepts at most {limit}.",
                           "messages" if chat else "prompt")
        field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        asked = body.token_limit if chat else body.max_tokens
        room = target.max_context - prompt_tokens
        if asked is not None and asked > config.max_tokens_cap:
            raise ApiError(400, f"{field} is {asked}; this server allows at most {config.max_tokens_cap}.", field)
        if asked is not None and asked > room:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens and {field} is {asked}, but the target's "
                                f"context holds {target.max_context} tokens.", field)
        if room < 1:
            raise ApiError(400, f"the prompt fills the target's context of {target.max_context} tokens.",
                           "messages" if chat else "prompt")
        kwargs["max_new_tokens"] = asked if asked is not None else min(config.max_tokens_cap, room)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        job = Job(request_id, kwargs, method, options, deadline=float("inf"), loop=asyncio.get_running_loop(),
                  stream=body.stream, user=body.user)
        return job, prompt_tokens

    return app


_ENDPOINTS = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


class _ApiKey:
    """401 with OpenAI's error JSON on ``/v1/*`` without the right ``Authorization: Bearer KEY``,
    decided from the headers alone, before the body is read or checked."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.api_key is None or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
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


def _json(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


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
