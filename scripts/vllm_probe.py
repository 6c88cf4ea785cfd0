"""Greedy completions through vLLM, with or without a speculative drafter, and vLLM's own counts.

Runs inside the vLLM venv (scripts/vllm-env.sh), never in specwise's: it imports only vLLM. Reads a
JSON job on stdin and writes one JSON line on stdout::

    {"model": HF_DIR, "dtype": "float32", "prompts": [[token ids], ...], "max_tokens": 64,
     "speculative_config": {...} | null, "model_impl": "auto" | "transformers"}

    -> {"ok": true, "outputs": [[token ids], ...], "seconds": s,
        "spec": {"drafts", "draft_tokens", "accepted", "accepted_per_position": [...]} | null}

A refusal at load or at the first step is reported as ``{"ok": false, "error": ..., "trace_tail": [...]}``
(the exact message, for docs/interop.md), never raised. Called by ``benchmarks/interop.py vllm-check``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback


def _spec_counts(llm) -> dict | None:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``) summed over the run."""
    found: dict = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:")
        if name == "spec_decode_num_drafts":
            found["drafts"] = found.get("drafts", 0) + metric.value
        elif name == "spec_decode_num_draft_tokens":
            found["draft_tokens"] = found.get("draft_tokens", 0) + metric.value
        elif name == "spec_decode_num_accepted_tokens":
            found["accepted"] = found.get("accepted", 0) + metric.value
        elif name == "spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            previous = found.get("accepted_per_position", [0] * len(values))
            found["accepted_per_position"] = [a + b for a, b in zip(previous, values)]
    return found or None


def main() -> int:
    job = json.load(sys.stdin)
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), seed=0, enforce_eager=True,
                  max_model_len=job.get("max_model_len", 2048), max_num_seqs=1,
                  speculative_config=job.get("speculative_config"), disable_log_stats=False,
                  model_impl=job.get("model_impl", "auto"),
                  # on the CPU backend this is the share of host memory vLLM reserves (weights + KV)
                  gpu_memory_utilization=job.get("memory_fraction", 0.25))
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
        outputs = []
        start = time.perf_counter()
        for ids in job["prompts"]:  # one at a time: the same schedule as specwise's single generations
            (result,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
            outputs.append(list(result.outputs[0].token_ids))
        seconds = time.perf_counter() - start
        spec = _spec_counts(llm) if job.get("speculative_config") else None
        print(json.dumps({"ok": True, "outputs": outputs, "seconds": seconds, "spec": spec}), flush=True)
    except Exception as exc:  # reported, not raised: the refusal is the finding
        lines = traceback.format_exc().strip().splitlines()
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "trace_tail": lines[-12:]}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
