"""llama.cpp's ``llama-server`` as a benchmark contender, on the same GGUF file and prompt tokens.

``llamacpp`` is plain decoding; options become server flags, so ``llamacpp[spec-type=ngram-map-k]``
is its n-gram speculation and ``llamacpp[draft=PATH]`` (``--spec-draft-model``) a draft model. The
server is started on first use with ``--poll 0`` (its threads sleep while other contenders are
timed) and as many threads as torch uses, with weight repacking off on CPUs with AMX (where
llama.cpp crashed on multi-token decodes with it on), and stopped at exit; ``command`` is the command
line it ran. Timings are the server's own:
``wall_time_s`` is prefill plus decoding (as specwise's own times are), ``decode_time_s`` the
decoding alone. Build a server with ``scripts/build-llama-server.sh``.
"""

from __future__ import annotations

import atexit
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specwise.errors import ConfigError
from specwise.targets.llamacpp_backend import repack_by_default

FLAG_ALIASES = {"draft": "spec-draft-model", "draft-max": "spec-draft-n-max"}


def built_without_amx(binary: Path) -> bool:
    """Whether ``binary`` was built with llama.cpp's AMX kernels left out, as the flags
    ``scripts/build-llama-server.sh`` writes beside it (``llama-server.build``) say: then weight
    repacking, the server's fastest setting, cannot reach the AMX matmul that crashed."""
    record = Path(f"{binary}.build")
    return record.exists() and "-DGGML_AMX_INT8=OFF" in record.read_text()


class LlamaServer:
    """One running ``llama-server`` process (started lazily, stopped by :meth:`close` or at exit)."""

    def __init__(self, binary: Path, gguf: Path, flags: dict[str, Any], threads: int) -> None:
        if not Path(binary).is_file():
            raise ConfigError(f"llama-server {binary} does not exist; build one with scripts/build-llama-server.sh.")
        self.binary, self.gguf, self.flags, self.threads = Path(binary), Path(gguf), flags, threads
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.command: list[str] = []

    def start(self) -> None:
        if self.process is not None:
            return
        with socket.socket() as probe:  # a free loopback port
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                   "-t", str(self.threads), "-tb", str(self.threads), "--poll", "0", "-c", "4096", "-np", "1"]
        for key, value in self.flags.items():
            command += [f"--{FLAG_ALIASES.get(key, key)}", str(value)]
        if not repack_by_default() and not built_without_amx(self.binary) and not {"repack", "no-repack"} & set(self.flags):
            command.append("--no-repack")  # repacked weights crash llama.cpp's AMX matmul (docs/llamacpp.md)
        self.command = command
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        atexit.register(self.close)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ConfigError(f"llama-server exited at start: {self.process.stderr.read()[-500:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                time.sleep(0.25)
        self.close()
        raise ConfigError("llama-server did not become healthy within 120 s.")

    def complete(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int | None,
                 ignore_eos: bool = False, json_schema: dict | None = None, cache_prompt: bool = False) -> dict:
        """``/completion`` on token ids; sampling is plain temperature sampling (no top-k, top-p, min-p,
        repetition penalty), as specwise's defaults are; ``ignore_eos`` generates past end-of-sequence;
        ``json_schema`` constrains the output by llama.cpp's own grammar support; ``cache_prompt`` keeps
        the slot's cache for a later prompt that continues this one (a conversation's next turn)."""
        self.start()
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "temperature": temperature, "top_k": 0,
                "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0, "seed": -1 if seed is None else seed,
                "cache_prompt": cache_prompt, "return_tokens": True, "stream": False, "ignore_eos": ignore_eos}
        if json_schema is not None:
            body["json_schema"] = json_schema
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.loads(reply.read())

    def describe(self) -> str:
        """The command line the server ran and the build flags recorded beside the binary."""
        record = Path(f"{self.binary}.build")
        build = record.read_text().strip() if record.exists() else "not recorded (built otherwise)"
        return f"`{' '.join(self.command) or '(not started)'}`; build: `{build}`"

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process = None

