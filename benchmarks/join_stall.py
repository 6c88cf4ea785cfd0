"""A running stream's largest gap between chunks while another request joins with a JSON schema
the server has not seen (issue #52: the grammar compiler and a joining request's setup stayed inside
the batch's round and stalled every stream for ~3 s).

    python benchmarks/join_stall.py    # specwise serve at its defaults on Gemma-3-270M, 3 trials
"""
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import Contender, free_port  # noqa: E402

port = free_port()
cmd = [sys.executable, "-m", "specwise.cli", "serve", "--target", "gemma-3-270m", "--port", str(port), "--log-level", "warning"]
server = Contender("s", cmd, port, Path("/tmp/join-stall-server.log"))
server.wait()
try:
    for trial in range(3):
        gaps, stamps = [], []
        def stream():
            body = {"model": "gemma-3-270m", "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 200,
                    "temperature": 0, "stream": True, "speculative": {"method": "ar"}}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.monotonic())
        t = threading.Thread(target=stream)
        t.start()
        while len(stamps) < 20:
            time.sleep(0.01)
        joined = time.monotonic()
        schema = {"type": "object", "properties": {f"field_{trial}_{i}": {"type": "string", "maxLength": 12} for i in range(6)},
                  "required": [f"field_{trial}_0"], "additionalProperties": False}
        body = {"model": "gemma-3-270m", "prompt": "Answer in JSON:", "max_tokens": 30, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        t.join()
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        before = [b - a for a, b in zip(stamps, stamps[1:]) if b < joined]
        after = [b - a for a, b in zip(stamps, stamps[1:]) if b >= joined]
        print(json.dumps({"trial": trial, "status": r.status_code, "median_gap_s": round(sorted(gaps)[len(gaps)//2], 4),
                          "max_gap_before_join_s": round(max(before), 4), "max_gap_after_join_s": round(max(after), 4)}), flush=True)
finally:
    server.stop()
