"""Measuring: where a measurement ran (recorded beside every benchmark and calibration), a clock,
and reading measurement files."""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from specwise.errors import ConfigError


def machine_info(device: torch.device) -> dict:
    """Where the measurement ran: platform, processor, threads, torch version, GPU name, and the
    1-minute load average when the measurement started."""
    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": _cpu_name(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": _notable_flags()}
    if hasattr(os, "getloadavg"):  # other jobs on the machine inflate and scatter the timings
        info["load_average_1min"] = round(os.getloadavg()[0], 2)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line); empty where unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def machine_key() -> str:
    """This machine as its measurements depend on it: architecture, processor name, vector and
    matrix extensions (two machines with one key time a target's forwards alike)."""
    return "|".join((platform.machine(), _cpu_name(), _notable_flags()))


def _notable_flags() -> str:
    """The CPU's vector and matrix extensions (what makes kernels and v(n) differ between machines)."""
    return " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json_atomically(path: Path, data, prefix: str = ".tmp-") -> bool:
    """Write ``data`` as JSON to ``path`` through a temporary file in its folder (concurrent writers:
    the last one wins, a reader never sees a torn file). Returns whether it was written: a cache
    that cannot be written is the caller's to skip, not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def read_json(path, missing: str) -> dict:
    """Read a JSON object from ``path``.

    Args:
        missing: the sentence to raise when the file does not exist (say what to run to make it).

    Raises:
        ConfigError: the file is missing or not JSON.
    """

    path = Path(path)
    if not path.is_file():
        raise ConfigError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc}).") from None


class DeviceClock:
    """Wall-clock seconds that first wait for the device's queued work (CUDA), so timings are real."""

    def __init__(self, device: torch.device) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def now(self) -> float:
        self._sync()
        return time.perf_counter()
