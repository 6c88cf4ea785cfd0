"""One target, its generations run by a worker fed by a bounded FIFO queue.

On a target that batches generations (the llama.cpp engine, :mod:`specwise.targets.batching`)
the worker runs up to ``max_batch`` of them at once, each on a thread of its own inside the
target's batch: every step is one forward over all of them, a finished one leaves and the next
waiting one joins between steps (continuous batching), and the draft budgets follow the load rule
(:mod:`specwise.engine.load`). On the torch engine a forward uses every core, so two generations
at once would only slow each other down: the worker runs them one after the other. Either way a
job runs off the event loop: its checked request (:class:`specwise.request.GenerationRequest`,
built once by :func:`specwise.serve.requests.prepare`) through :func:`specwise.request.run_request`,
as :func:`specwise.generate` runs one (the server has no decoding path of its own).
``specwise serve`` runs the worker on the process's main thread and the event loop on another:
torch's CPU forwards measured markedly slower on any thread but the main one (docs/serve.md). Each job streams its text pieces back to the event
loop as they are committed; a job whose client went away, or that ran past the time limit, is
stopped at its next step and its state (KV cache, drafter state) is freed with it. A job whose
client left while it waited leaves the queue at once; on shutdown the waiting jobs are refused and
the running one stops at its next step (503 either way).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Any

from specwise.drafters.building import build_drafter, shared_drafter
from specwise.engine.capacity import footprint
from specwise.engine.grammar import GrammarError
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import StepTokens
from specwise.errors import CapacityError, EngineError, SpecwiseError
from specwise.many import batch_load, batches_generations
from specwise.output import grammar_compiler
from specwise.request import GenerationRequest, run_request
from specwise.serve.origins import TokenSpans
from specwise.serve.protocol import DEFAULT_TEMPERATURE, ApiError
from specwise.targets.measured import verify_costs
from specwise.targets.openmp import openmp_runtimes, release_pool

log = logging.getLogger("specwise.serve")

class Stopped(Exception):
    """Raised inside a generation's streamer to end it; its text is the reason (a :class:`StopReason`)."""


class StopReason:
    """Why a job stopped before its end."""

    CANCELLED = "cancelled"  # the client went away
    TIME_LIMIT = "time limit"
    SHUTDOWN = "shutdown"


@dataclasses.dataclass(eq=False)
class Job:
    """One request's generation.

    Attributes:
        id: the request id (``chatcmpl-...`` / ``cmpl-...``).
        request: the checked generation (:class:`specwise.request.GenerationRequest`), run unchanged.
        deadline: ``time.monotonic()`` after which the job is stopped.
        stream: whether the text is wanted piece by piece; otherwise it is gathered in ``pieces``
            on the worker's thread (no event per step for a client that reads only the end).
        events: ``("text", (str, step))`` pieces when streaming (``step``: the step's tokens as text
            spans with their origins, :func:`specwise.serve.origins.TokenSpans.step`, when ``origins``
            is asked for, else ``None``), then ``("done", GenerationResult)`` or ``("error", ApiError)``,
            delivered on the event loop.
        origins: stream where each token came from (an accepted draft, the target, the grammar).
        stop_reason: set when the job is to stop at its next step (a :class:`StopReason`).
    """

    id: str
    request: GenerationRequest
    deadline: float
    loop: asyncio.AbstractEventLoop
    stream: bool = True
    user: str | None = None  # OpenAI's end-user id, logged with the request
    seat: Any = None  # its reservation in the target's pool while it runs in a batch
    origins: bool = False
    pieces: list[str] = dataclasses.field(default_factory=list)
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    stop_reason: str | None = None
    started: float | None = None
    first_token: float | None = None
    tokens: int = 0
    submitted: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens (admission by capacity counts it)."""
        return self.request.prompt_tokens

    def stop(self, reason: str) -> None:
        """Stop at the next step (the first reason given is kept)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def emit(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is left to read it
            pass

    def check(self) -> None:
        if self.stop_reason is not None:
            raise Stopped(self.stop_reason)
        if time.monotonic() > self.deadline:
            raise Stopped(StopReason.TIME_LIMIT)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another server or later.", kind="server_error",
                    headers={"Retry-After": "5"})


class GenerationWorker:
    """Runs jobs first in first out, on its own thread or the caller's: one at a time, or up to
    ``max_batch`` at once in the target's batch where the target batches generations.

    A job withdrawn while it waits (its client left) leaves the queue at once; :meth:`shutdown`
    refuses the waiting jobs (503) and stops the running ones at their next step.

    Args:
        target: the loaded :class:`specwise.targets.hf.Target`.
        methods: the methods requests may use; their default drafters are built by :meth:`start`.
        max_queue: jobs that may wait behind the running one; beyond, :meth:`submit` refuses (503).
        time_limit_s: seconds a job may run (queueing not counted) before it is stopped.
        metrics: a :class:`specwise.serve.metrics.ServerMetrics`.
        built_options: options of a method's drafter built at start, by method (default none).
        max_batch: generations running at once on a batching target (1: one at a time; capped
            by the target's cache ranges). On a target whose generations share one pool of cache
            cells (``target.capacity``), each also reserves its worst case before it starts
            (:mod:`specwise.engine.capacity`): the first waiting job waits until the running ones
            leave room, and one that could not fit even alone is refused by :meth:`submit` (400).
    """

    def __init__(self, target, methods: list[str], max_queue: int, time_limit_s: float, metrics,
                 built_options: dict[str, dict[str, Any]] | None = None, max_batch: int = 1) -> None:
        self.target = target
        self.methods = list(methods)
        self.max_queue = max_queue
        self.time_limit_s = time_limit_s
        self.metrics = metrics
        self.built_options = built_options or {}
        self._jobs: deque[Job] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._running: set[Job] = set()
        self.max_batch = self._batch_width(target, max_batch)
        self._capacity = getattr(target, "capacity", None) if self.max_batch > 1 else None
        self._load = None
        self._drafters: dict[str, Any] = {}
        self._thread = threading.Thread(target=self.run, name="specwise-worker", daemon=True)

    def start(self, thread: bool = True) -> None:
        """Build every allowed method's default drafter (loading its weights); with ``thread``, start
        running jobs on a thread of the worker's own (else the caller runs :meth:`run`).

        Raises:
            SpecwiseError: a method or its drafter cannot be built for the target.
        """
        for method in self.methods:
            self._drafters[method] = build_drafter(self.target, method, **self.built_options.get(method, {}))
        try:  # seconds of work: now, not inside the first constrained request
            if getattr(self.target, "tokenizer", None) is not None:
                grammar_compiler(self.target)
        except SpecwiseError as exc:  # a constrained request will say so itself
            log.warning("constrained output is not available on %s: %s", getattr(self.target, "name", "the target"), exc)
        self.metrics.watch_index(self.target)
        if self.max_batch > 1:
            self._load = batch_load(self.target, on_decision=self.metrics.record_decision)
            self.metrics.watch_pool(self.target)
        elif any(method != "ar" for method in self.methods):
            verify_costs(self.target)  # the cost model's v(n): now, not inside the first request
        # auto's first measurements, once per machine, now (not in a batch whose steps time the others
        # too): greedy, and sampling at the API's default temperature, which the other sampled regimes
        # borrow from until their own steps are measured
        for drafter in self._drafters.values():
            if hasattr(drafter, "calibrate"):
                drafter.calibrate(SamplingConfig())
                drafter.calibrate(SamplingConfig(temperature=DEFAULT_TEMPERATURE))
        # what was measured here ran on this thread, which stays: its idle OpenMP workers would slow
        # every generation's own team (specwise.targets.openmp)
        release_pool(openmp_runtimes())
        if thread:
            self._thread.start()

    @staticmethod
    def _batch_width(target, max_batch: int) -> int:
        if max_batch <= 1 or not batches_generations(target):
            if max_batch > 1:
                log.info("the %s engine runs one generation at a time (--max-batch %d not used)",
                         getattr(target, "engine", "torch"), max_batch)
            return 1
        return max(1, min(max_batch, getattr(target, "max_generations", max_batch)))

    def shutdown(self) -> None:
        """Refuse new and waiting jobs (503), stop the running ones at their next step (they end
        with a 503), and let :meth:`run` return; returns at once."""
        with self._changed:
            self._closing = True
            refused, self._jobs = list(self._jobs), deque()
            self._set_gauges()
            for running in self._running:
                running.stop(StopReason.SHUTDOWN)
            self._changed.notify_all()
        for job in refused:
            job.stop(StopReason.SHUTDOWN)
            job.emit("error", shutting_down())
        if refused:
            log.info("shutting down: %d waiting requests refused", len(refused))

    def close(self) -> None:
        """:meth:`shutdown`, then wait (up to a minute) for a worker thread of its own and the
        running generations to end."""
        self.shutdown()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._wait_running(60.0)

    def _wait_running(self, timeout_s: float) -> None:
        """Wait until no generation runs (they stop at their next step after :meth:`shutdown`), so
        the engine's context is never freed under a running decode; at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._running and time.monotonic() < deadline:
                self._changed.wait(timeout=0.2)
            if self._running:
                log.warning("shutting down with %d generations still running", len(self._running))

    @property
    def waiting(self) -> int:
        """Jobs in the queue (not counting the running one)."""
        return len(self._jobs)

    @property
    def running(self) -> int:
        """Jobs generating now (at most ``max_batch``)."""
        return len(self._running)

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            ApiError: 503 with ``Retry-After`` when ``max_queue`` jobs are already waiting, or the
                server is shutting down.
        """
        need = self._need(job)
        if need is not None and not self._capacity.fits_alone(need):
            raise ApiError(400, self._capacity.refusal(need), "max_tokens")
        with self._changed:
            if self._closing:
                raise shutting_down()
            if len(self._jobs) >= self.max_queue:
                raise ApiError(503, f"the server is busy: {len(self._jobs)} requests are waiting; retry shortly.",
                               kind="server_error", headers={"Retry-After": "1"})
            self._jobs.append(job)
            self._set_gauges()
            self._changed.notify_all()

    def withdraw(self, job: Job) -> bool:
        """The client of ``job`` went away: a waiting job leaves the queue now, a running one stops at
        its next step; a finished one is left as it is. Returns whether it was waiting."""
        job.stop(StopReason.CANCELLED)
        with self._changed:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            self._set_gauges()
        return True

    def run(self) -> None:
        """Run jobs in order until :meth:`shutdown`; returns once the running ones have ended (they stop
        at their next step), so the engine is never freed under them."""
        while True:
            with self._changed:
                while not self._closing and not self._admit_next():
                    self._changed.wait(timeout=1.0)  # a timeout lets a signal handler run on this thread
                if self._closing:
                    break
                job = self._jobs.popleft()
                self._running.add(job)
                self._set_gauges()
            if self.max_batch == 1:
                self._run(job)
            else:
                threading.Thread(target=self._run, args=(job,), name=f"specwise-{job.id}", daemon=True).start()
        self._wait_running(60.0)

    def _admit_next(self) -> bool:
        """Whether the first waiting job may start now: a batch seat is free and, on a shared pool,
        its worst case is reserved (it waits, first in line, until the running ones leave room)."""
        if not self._jobs or len(self._running) >= self.max_batch:
            return False
        job = self._jobs[0]
        need = self._need(job)
        if need is None:
            return True
        job.seat = self._capacity.try_reserve(need)
        return job.seat is not None

    def _need(self, job: Job):
        """``job``'s worst case in the target's pool (:func:`specwise.engine.capacity.footprint`),
        or ``None`` where generations do not share one (one at a time, or no pool)."""
        if self._capacity is None:
            return None
        return footprint(job.prompt_tokens, job.request.max_new_tokens, self.target.max_context,
                         bool(getattr(job.request.drafter, "side_forwards", False)))

    def _set_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self._jobs))
        self.metrics.running.set(len(self._running))

    def _run(self, job: Job) -> None:
        try:
            self._run_job(job)
        finally:
            if job.seat is not None:
                job.seat.release()
            with self._changed:
                self._running.discard(job)
                self._set_gauges()
                self._changed.notify_all()

    def _run_job(self, job: Job) -> None:
        try:
            job.emit("done", self._generate(job) if self._load is None else self._generate_in_batch(job))
        except Stopped as stop:
            if str(stop) == StopReason.TIME_LIMIT:
                job.emit("error", ApiError(504, f"the request ran past this server's time limit of "
                                                f"{self.time_limit_s:g} s.", kind="timeout_error"))
            elif str(stop) == StopReason.SHUTDOWN:
                log.info("%s stopped after %d tokens: the server is shutting down", job.id, job.tokens)
                job.emit("error", shutting_down())
        except ApiError as exc:
            job.emit("error", exc)
        except CapacityError as exc:  # the engine's room, not the request: another time it fits
            log.warning("request %s: %s", job.id, exc)
            job.emit("error", ApiError(503, str(exc), kind="server_error", headers={"Retry-After": "1"}))
        except EngineError as exc:
            log.error("request %s failed in the engine: %s", job.id, exc)
            job.emit("error", ApiError(500, f"the engine failed on this request: {exc}", kind="server_error"))
        except GrammarError as exc:  # e.g. a grammar that outgrew the parser's limits mid-generation
            job.emit("error", ApiError(400, str(exc), "response_format"))
        except SpecwiseError as exc:  # bad input the cheap checks could not see (e.g. a chat template)
            job.emit("error", ApiError(400, str(exc)))
        except Exception:  # noqa: BLE001 - the client gets one sentence, the log the traceback
            log.exception("request %s failed", job.id)
            job.emit("error", ApiError(500, "the server failed to generate this response; see its log.",
                                       kind="server_error"))

    def _generate(self, job: Job, load=None):
        job.started = time.monotonic()
        job.deadline = job.started + self.time_limit_s

        spans = TokenSpans(self.target) if job.stream and job.origins else None
        held: list[str] = []  # a step's text, sent with its tokens' origins when the step's tokens come

        def on_tokens(tokens: StepTokens) -> None:
            if job.first_token is None:
                job.first_token = time.monotonic()
            job.tokens += len(tokens)
            self.metrics.generated_tokens.inc(len(tokens))
            if held or spans is not None:
                job.emit("text", ("".join(held), spans.step(tokens) if spans is not None else None))
                held.clear()
            job.check()

        def on_text(piece: str) -> None:
            (held if job.stream else job.pieces).append(piece)

        job.check()
        return run_request(self.target, job.request, streamer=on_tokens, text_streamer=on_text, load=load)

    def _generate_in_batch(self, job: Job):
        """:meth:`_generate` inside the target's batch, with a seat in the load rule."""
        share = self._load.join()
        try:
            with self.target.batch_member():
                return self._generate(job, share)
        finally:
            share.leave()

    def drafter(self, method: str, options: dict[str, Any]):
        """The drafter for ``method`` with ``options``: the one built at start, or the target's kept
        drafter for this option set (:func:`specwise.drafters.building.shared_drafter`)."""
        if not options:
            return self._drafters[method]
        return shared_drafter(self.target, method, **options)
