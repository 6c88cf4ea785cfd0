"""A ``specwise serve`` subprocess for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_process(app) -> Iterator[str]:
    """Run the ASGI ``app`` on uvicorn in this process (a thread of its own): yields its URL once
    ``/health`` answers; then stops uvicorn and closes the app's worker."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)
    app.state.worker.close()


class Server:
    """A ``specwise serve`` subprocess; ``stop()`` ends it."""

    def __init__(self, model_dir: Path, *args: str, target: str | None = None) -> None:
        """Serve the tiny float64 model in ``model_dir``, or ``target`` (with its dtype in ``args``);
        the log goes next to ``model_dir``."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        self.log = open(model_dir.parent / f"server-{self.port}.log", "w")
        what = ["--target", target] if target else ["--target", str(model_dir), "--dtype", "float64"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specwise.cli", "serve", *what, "--port", str(self.port), "--log-level", "warning",
             *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + (120 if target is None else 900)
        while time.monotonic() < deadline:
            assert self.process.poll() is None, Path(self.log.name).read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("the server did not start: " + Path(self.log.name).read_text())

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def healthy(self) -> bool:
        return httpx.get(f"{self.url}/health", timeout=5).json()["status"] == "ok"

    def stop(self, sig: int = signal.SIGINT) -> int | None:
        """Send ``sig``; the exit code, or ``None`` if the process had to be killed."""
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = None
        self.log.close()
        return code
