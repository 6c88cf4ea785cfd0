"""One target, one generation at a time: a worker fed by a bounded FIFO queue.

A forward on the CPU uses every core, so two generations at once would only slow each other down;
the worker runs them one after the other, off the event loop, through :func:`specwise.generate`
(the server has no decoding path of its own). ``specwise serve`` runs the worker on the process's
main thread and the event loop on another: torch's CPU forwards measured markedly slower on any
thread but the main one (docs/serve.md). Each job streams its text pieces back to the event
loop as they are committed; a job whose client went away, or that ran past the time limit, is
stopped at its next step and its state (KV cache, drafter state) is freed with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

from specwise.api import build_drafter, generate
from specwise.drafters import METHODS
from specwise.errors import SpecwiseError
from specwise.serve.protocol import ApiError

log = logging.getLogger("specwise.serve")

#: string options a request may set (all others a request may set are numbers or flags)
STRING_OPTIONS = frozenset({"match"})
#: options no request may set: weights on disk, and a lossy acceptance rule
FORBIDDEN_OPTIONS = frozenset({"drafter_path", "acceptance"})
#: the largest integer option a request may set (a client must not make one step verify thousands of tokens)
MAX_INT_OPTION = 64
#: drafters kept for per-request option sets, besides the ones built at start
CACHED_DRAFTERS = 4


def request_options(method: str) -> frozenset[str]:
    """The options of ``method`` a request may set: its numeric and flag options, ``match``; never
    a path or the lossy acceptance rule."""
    fields = dataclasses.fields(METHODS.get(method).config_cls)
    return frozenset(f.name for f in fields if f.name not in FORBIDDEN_OPTIONS and (
        type(f.default) in (int, float, bool) or f.name in STRING_OPTIONS))


def check_request_options(method: str, options: dict[str, Any]) -> None:
    """Refuse request options outside the allowlist or out of range.

    Raises:
        ApiError: 400 naming the option.
    """
    allowed = request_options(method)
    for key, value in options.items():
        if key not in allowed:
            listed = ", ".join(sorted(allowed)) or "none"
            raise ApiError(400, f"option {key!r} cannot be set per request for method {method!r} "
                                f"(allowed: {listed}).", f"speculative.options.{key}")
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT_OPTION:
            raise ApiError(400, f"option {key!r} is {value}; this server allows at most {MAX_INT_OPTION}.",
                           f"speculative.options.{key}")
    try:
        METHODS.get(method).make_config(**options)
    except SpecwiseError as exc:
        raise ApiError(400, str(exc), "speculative.options") from None


class Stopped(Exception):
    """Raised inside a generation's streamer to end it: the client left, or the time limit passed."""


@dataclasses.dataclass
class Job:
    """One request's generation.

    Attributes:
        id: the request id (``chatcmpl-...`` / ``cmpl-...``).
        kwargs: keyword arguments of :func:`specwise.generate` (prompt or messages, sampling, stop, ...).
        method, options: the drafter.
        deadline: ``time.monotonic()`` after which the job is stopped.
        stream: whether the text is wanted piece by piece; otherwise it is gathered in ``pieces``
            on the worker's thread (no event per step for a client that reads only the end).
        events: ``("text", str)`` pieces when streaming, then ``("done", GenerationResult)`` or
            ``("error", ApiError)``, delivered on the event loop.
    """

    id: str
    kwargs: dict[str, Any]
    method: str
    options: dict[str, Any]
    deadline: float
    loop: asyncio.AbstractEventLoop
    stream: bool = True
    user: str | None = None  # OpenAI's end-user id, logged with the request
    pieces: list[str] = dataclasses.field(default_factory=list)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    started: float | None = None
    first_token: float | None = None
    submitted: float = dataclasses.field(default_factory=time.monotonic)

    def cancel(self) -> None:
        """Stop at the next step (the client went away)."""
        self.cancelled.set()

    def emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def check(self) -> None:
        if self.cancelled.is_set():
            raise Stopped("cancelled")
        if time.monotonic() > self.deadline:
            raise Stopped("time limit")


class GenerationWorker:
    """Runs jobs one at a time on its own thread, first in first out.

    Args:
        target: the loaded :class:`specwise.engine.target.Target`.
        methods: the methods requests may use; their default drafters are built by :meth:`start`.
        max_queue: jobs that may wait behind the running one; beyond, :meth:`submit` refuses (503).
        time_limit_s: seconds a job may run (queueing not counted) before it is stopped.
        metrics: a :class:`specwise.serve.metrics.ServerMetrics`.
        built_options: options of a method's drafter built at start, by method (default none).
    """

    def __init__(self, target, methods: list[str], max_queue: int, time_limit_s: float, metrics,
                 built_options: dict[str, dict[str, Any]] | None = None) -> None:
        self.target = target
        self.methods = list(methods)
        self.max_queue = max_queue
        self.time_limit_s = time_limit_s
        self.metrics = metrics
        self.built_options = built_options or {}
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._drafters: dict[str, Any] = {}
        self._cached: OrderedDict[tuple, Any] = OrderedDict()
        self._thread = threading.Thread(target=self.run, name="specwise-worker", daemon=True)

    def start(self, thread: bool = True) -> None:
        """Build every allowed method's default drafter (loading its weights); with ``thread``, start
        running jobs on a thread of the worker's own (else the caller runs :meth:`run`).

        Raises:
            SpecwiseError: a method or its drafter cannot be built for the target.
        """
        for method in self.methods:
            self._drafters[method] = build_drafter(self.target, method, **self.built_options.get(method, {}))
        if thread:
            self._thread.start()

    def close(self) -> None:
        """Let the running job finish, refuse the waiting ones (503), and end :meth:`run`."""
        with self._lock:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.emit("error", ApiError(503, "the server is shutting down.", kind="server_error"))
            self._jobs.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    @property
    def waiting(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            ApiError: 503 with ``Retry-After`` when ``max_queue`` jobs are already waiting.
        """
        with self._lock:
            if self._waiting >= self.max_queue:
                raise ApiError(503, f"the server is busy: {self._waiting} requests are waiting; retry shortly.",
                               kind="server_error", headers={"Retry-After": "1"})
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)
            self._jobs.put(job)

    def run(self) -> None:
        """Run jobs in order until :meth:`close`."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self.metrics.queue_depth.set(self._waiting)
            if job.cancelled.is_set():
                continue
            self.metrics.running.set(1)
            try:
                job.emit("done", self._generate(job))
            except Stopped as stop:
                if str(stop) == "time limit":
                    job.emit("error", ApiError(504, f"the request ran past this server's time limit of "
                                                    f"{self.time_limit_s:g} s.", kind="timeout_error"))
            except ApiError as exc:
                job.emit("error", exc)
            except SpecwiseError as exc:  # bad input the cheap checks could not see (e.g. a chat template)
                job.emit("error", ApiError(400, str(exc)))
            except Exception:  # noqa: BLE001 - the client gets one sentence, the log the traceback
                log.exception("request %s failed", job.id)
                job.emit("error", ApiError(500, "the server failed to generate this response; see its log.",
                                           kind="server_error"))
            finally:
                self.metrics.running.set(0)

    def _generate(self, job: Job):
        job.started = time.monotonic()
        job.deadline = job.started + self.time_limit_s

        def on_tokens(tokens: list[int]) -> None:
            if job.first_token is None:
                job.first_token = time.monotonic()
            self.metrics.generated_tokens.inc(len(tokens))
            job.check()

        def on_text(piece: str) -> None:
            if job.stream:
                job.emit("text", piece)
            else:
                job.pieces.append(piece)

        job.check()
        return generate(self.target, drafter=self._drafter(job.method, job.options), streamer=on_tokens,
                        text_streamer=on_text, include_stop=False, **job.kwargs)

    def _drafter(self, method: str, options: dict[str, Any]):
        """The drafter for ``method`` with ``options``: the one built at start, or one built for this
        option set (a few are kept, least recently used dropped)."""
        if not options:
            return self._drafters[method]
        key = (method, tuple(sorted(options.items())))
        drafter = self._cached.pop(key, None)
        if drafter is None:
            drafter = build_drafter(self.target, method, **options)
        self._cached[key] = drafter
        while len(self._cached) > CACHED_DRAFTERS:
            self._cached.popitem(last=False)
        return drafter
