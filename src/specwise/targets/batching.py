"""Several generations' forwards in one engine call: the gathering half of continuous batching.

Each generation runs its own decoding loop on its own thread, unchanged; a thread that enrolls as
a *member* (:meth:`DecodeBatcher.member`) has its target forwards gathered with every other
member's: when every member has one waiting, the last to arrive runs them all in one call of the
engine (``run_many``) and wakes the others. A generation joins the batch at its first forward (what
it does before, tokenizing, compiling a grammar, building its drafter, never holds up the others'
rounds) and leaves it when its ``member`` block ends (finished, cancelled, timed out or failed), so
the batch changes between steps, never inside one. A thread that is not a member runs its
forwards alone, as before.

Each request carries its own cache (a range of sequence ids on the llama.cpp engine), so what one
generation computes does not depend on which others share its step, except through the engine's
kernels (a batched matmul may round a near-tie otherwise, as a longer verification can).
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass
class RoundTimes:
    """Where a batch's time went since the batcher was made (units: seconds).

    Attributes:
        rounds: batched rounds run (one engine call each).
        engine_s: time inside those engine calls.
        between_s: time from one round's end to the next one's start while a member stayed in the
            batch: the members' own work between two rounds (verifying, drafting, streaming), all
            of which the next round waits for. Time with no member is not counted.
    """

    rounds: int = 0
    engine_s: float = 0.0
    between_s: float = 0.0


@dataclass(eq=False)
class DecodeRequest:
    """One generation's forward, waiting to be run with others.

    Attributes:
        payload: what the engine's ``run_many`` reads (its own shape).
        result: what ``run_many`` set for it.
        error: the exception ``run_many`` raised, re-raised on the request's own thread.
    """

    payload: Any
    result: Any = None
    error: BaseException | None = None
    done: bool = field(default=False, repr=False)


class DecodeBatcher:
    """Gathers the members' forwards and runs each round in one ``run_many`` call.

    Args:
        run_many: ``list[DecodeRequest] -> None``; sets each request's ``result`` (it serializes
            engine access itself, so a lone forward from a non-member can use it too).
    """

    def __init__(self, run_many: Callable[[list[DecodeRequest]], None]) -> None:
        self._run_many = run_many
        self._changed = threading.Condition()
        self._members: set[int] = set()
        self._joined: set[int] = set()  # members that have submitted a forward: each round waits for these
        self._pending: list[DecodeRequest] = []
        self._running = False
        self._ended: float | None = None  # when the last round ended, while a member stayed
        self.times = RoundTimes()

    @property
    def rounds(self) -> int:
        """Batched rounds run so far."""
        return self.times.rounds

    @property
    def members(self) -> int:
        """Threads enrolled now (generations running in the batch)."""
        return len(self._members)

    def is_member(self) -> bool:
        """Whether the calling thread is enrolled.

        Read without the lock: only the calling thread enrolls or leaves itself, so the answer about
        itself cannot change while it asks (and a set lookup is atomic), and the lock is what every
        member waiting for its round contends for."""
        return threading.get_ident() in self._members

    @contextmanager
    def member(self) -> Iterator[None]:
        """Enroll the calling thread for the block: its forwards run batched with the other members'."""
        ident = threading.get_ident()
        with self._changed:
            if ident in self._members:
                raise RuntimeError("this thread is already a member of the batch")
            self._members.add(ident)
        try:
            yield
        finally:
            with self._changed:
                self._members.discard(ident)
                self._joined.discard(ident)
                if not self._members:
                    self._ended = None  # an idle batch is not time between rounds
                self._changed.notify_all()  # the others may all be waiting for this one

    def submit(self, payload: Any, member: bool | None = None) -> Any:
        """Run one forward: alone for a non-member, else with the members' next round.

        Args:
            member: whether the calling thread is a member, if the caller has just asked
                (:meth:`is_member`); ``None`` asks.

        Returns:
            what ``run_many`` set as the request's result.

        Raises:
            whatever ``run_many`` raised for the round.
        """
        request = DecodeRequest(payload)
        if not (self.is_member() if member is None else member):
            self._run_many([request])
        else:
            self._wait_for_round(request)
        if request.error is not None:
            raise request.error
        return request.result

    def _wait_for_round(self, request: DecodeRequest) -> None:
        with self._changed:
            self._joined.add(threading.get_ident())
            self._pending.append(request)
            self._changed.notify_all()
            while not request.done:
                if self._running or len(self._pending) < len(self._joined):
                    self._changed.wait(timeout=0.5)
                    continue
                batch, self._pending, self._running = self._pending, [], True
                began = time.perf_counter()
                if self._ended is not None:
                    self.times.between_s += began - self._ended
                self._changed.release()
                try:
                    self._run_many(batch)
                except BaseException as exc:  # noqa: BLE001 - every request of the round gets it
                    for item in batch:
                        item.error = item.error or exc
                finally:
                    self._changed.acquire()
                    for item in batch:
                        item.done = True
                    self._running = False
                    ended = time.perf_counter()
                    self._ended = ended if self._members else None
                    self.times.rounds += 1
                    self.times.engine_s += ended - began
                    self._changed.notify_all()


@dataclass(eq=False)
class _Call:
    run: Callable[[], Any] | None
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class EngineThread:
    """One long-lived thread that runs every call given to :meth:`call`, the caller waiting.

    An engine whose kernels run on an OpenMP team (ggml's CPU backend) keeps one team of worker
    threads per thread that calls it, and a team its caller has left idle keeps spinning for a
    while on the cores the next call needs. Batched generations call from many threads (the last
    member to arrive runs the round), so every call is made from this one thread instead
    (docs/serve.md, "Concurrency and limits", measured there).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve_calls, args=(self._calls,), name=name, daemon=True)
        self._thread.start()

    def call(self, run: Callable[[], Any]) -> Any:
        """``run()`` on the engine thread (directly when called from it); its result, or what it raised."""
        if threading.current_thread() is self._thread:
            return run()
        call = _Call(run)
        self._calls.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def close(self) -> None:
        """End the thread once the calls already given have run (a later :meth:`call` would wait forever)."""
        self._calls.put(None)


def _serve_calls(calls: queue.SimpleQueue) -> None:
    # a function, not a method: the thread must not keep its owner alive between calls
    while (call := calls.get()) is not None:
        try:
            call.result = call.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            call.error = exc
        finally:
            call.run = None  # the callable may hold its owner: drop it before waiting for the next
            call.done.set()
        del call
