"""Blocking work off the event loop on a thread that ends with it (specwise.serve.own_thread)."""

import asyncio
import threading

import pytest

from specwise.serve.own_thread import in_own_thread


def test_the_result_comes_back_from_a_thread_that_has_ended():
    seen: list[threading.Thread] = []

    def work(a, b):
        seen.append(threading.current_thread())
        return a + b

    assert asyncio.run(in_own_thread(work, 2, 3)) == 5
    assert seen[0] is not threading.main_thread()
    seen[0].join(timeout=5)
    assert not seen[0].is_alive()  # no pool of the thread's (e.g. OpenMP's) outlives the call


def test_an_exception_is_raised_on_the_event_loop():
    def fail():
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        asyncio.run(in_own_thread(fail))


def test_a_cancelled_caller_leaves_the_work_to_finish_quietly():
    release, finished = threading.Event(), threading.Event()

    def slow():
        release.wait(5)
        finished.set()
        return "late"

    async def main():
        task = asyncio.ensure_future(in_own_thread(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.sleep(0.2)  # the late result must not raise InvalidStateError on the loop

    asyncio.run(main())
    assert finished.wait(5)
