"""Blocking work for the event loop on a thread that ends with it.

Why not asyncio's default executor: its threads live on, and one that has run a parallel torch op
(e.g. a grammar's first token mask over the vocabulary) keeps an idle OpenMP pool that slows
every later ggml forward (:mod:`specwise.targets.openmp`). A thread that ends takes its pool with
it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


async def in_own_thread(func: Callable[..., Any], *args: Any, name: str = "specwise-prepare") -> Any:
    """``func(*args)`` on a new thread, awaited without blocking the event loop.

    Returns:
        what ``func`` returned.

    Raises:
        whatever ``func`` raised. Cancelling the awaiting task leaves ``func`` to finish on its
        thread; its result is dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome = (func(*args), None)
        except BaseException as exc:  # noqa: BLE001 - raised again on the event loop
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the event loop has closed: nobody is left to read it
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future
