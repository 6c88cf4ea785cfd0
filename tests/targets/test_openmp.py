"""The calling thread's OpenMP pool let go (specwise.targets.openmp)."""

import os
import threading

import pytest
import torch

from specwise.targets.openmp import openmp_runtimes, release_pool, set_team


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_no_runtime_found_in_maps_without_one_and_releasing_none_is_fine():
    assert openmp_runtimes("") == ()
    assert openmp_runtimes("7f00-7f01 r-xp 0 00:00 0 /usr/lib/libc.so.6\n") == ()
    assert release_pool(()) is True


@pytest.fixture
def runtimes():
    """The process's libgomp, torch on two threads for the test (the suite runs it on one, conftest)."""
    if not os.path.exists("/proc/self/task"):
        pytest.skip("counts threads through /proc")
    found = openmp_runtimes()
    if not found or (os.cpu_count() or 1) < 2:
        pytest.skip("needs torch on libgomp and two cores")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield found
    torch.set_num_threads(before)


def test_a_thread_that_stays_lets_its_idle_workers_go(runtimes):
    _check_released(runtimes)


def _check_released(runtimes) -> None:
    counts, go_on, done = {}, threading.Event(), threading.Event()

    def stays():
        float(torch.ones(1 << 20).mul(2).sum())  # a parallel region: this thread now keeps a pool
        counts["with pool"] = _threads()
        counts["released"] = release_pool(runtimes)
        go_on.wait(5)  # the pool's workers exit while this thread lives on
        counts["after"] = _threads()
        done.set()

    thread = threading.Thread(target=stays)
    thread.start()
    for _ in range(50):
        if "released" in counts:
            break
        threading.Event().wait(0.05)
    threading.Event().wait(0.2)
    go_on.set()
    thread.join(10)
    assert counts["released"] is True
    assert counts["after"] < counts["with pool"]


def test_a_thread_set_to_one_runs_torch_without_a_team_and_gets_it_back(runtimes):
    counts = {}

    def member():
        start = _threads()
        set_team(runtimes, 1)
        float(torch.ones(1 << 20).mul(2).sum())  # large enough for a parallel region
        counts["alone"] = _threads() - start
        set_team(runtimes, 2)
        float(torch.ones(1 << 20).mul(2).sum())
        counts["team"] = _threads() - start

    thread = threading.Thread(target=member)
    thread.start()
    thread.join(10)
    assert counts == {"alone": 0, "team": 1}
