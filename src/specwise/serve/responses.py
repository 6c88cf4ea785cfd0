"""A finished or running generation as OpenAI's response shapes: one JSON body, or Server-Sent
Events (one chunk per committed step), with ``usage`` and a ``speculative_decoding`` summary."""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator

from fastapi.sse import format_sse_event

from specwise.serve.protocol import finish_reason, now, speculative_decoding, usage

log = logging.getLogger("specwise.serve")


def _json(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def completion_body(job, result, model: str, chat: bool, prompt_tokens: int) -> dict:
    """The non-streamed response to ``job``, whose generation returned ``result``."""
    text = "".join(job.pieces)
    reason = finish_reason(result)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {"id": job.id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, result),
            "speculative_decoding": speculative_decoding(result.stats)}


async def stream_events(job, body, chat: bool, model: str, prompt_tokens: int, on_done) -> AsyncIterator[bytes]:
    """The SSE chunks of ``job`` as its events arrive, then ``data: [DONE]``; an error event (the
    time limit, a shutdown) ends the stream the same way.

    Args:
        job: the running :class:`~specwise.serve.worker.Job`. body: the parsed request.
        on_done: called with the result when the generation finishes (metrics, the log line).

    Returns (yields):
        each chunk as bytes. Whether the stream reached its end is ``job``'s to tell: the caller
        withdraws the job whatever happened.
    """
    created, kind_name = now(), "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if body.include_usage else {}

    def chunk(choices: list) -> bytes:
        data = {"id": job.id, "object": kind_name, "created": created, "model": model, "choices": choices, **extra}
        return format_sse_event(data_str=_json(data))

    def choice(text: str | None, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

    if chat:
        yield chunk([choice(None, None, role=True)])
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            yield chunk([choice(value, None)])
            continue
        if kind == "error":
            yield format_sse_event(data_str=_json(value.body()))
            break
        on_done(value)
        yield chunk([choice(None, finish_reason(value))])
        if body.include_usage:
            data = {"id": job.id, "object": kind_name, "created": created, "model": model, "choices": [],
                    "usage": usage(prompt_tokens, value), "speculative_decoding": speculative_decoding(value.stats)}
            yield format_sse_event(data_str=_json(data))
        break
    yield format_sse_event(data_str="[DONE]")


def record_finished(metrics, job, result, prompt_tokens: int) -> None:
    """A finished generation into the metrics and the log (one line per request)."""
    end = time.monotonic()
    metrics.record_result(result)
    metrics.latency.observe(end - job.submitted)
    if job.first_token is not None:
        metrics.time_to_first_token.observe(job.first_token - job.submitted)
    stats = result.stats
    log.info("%s user=%s method=%s prompt_tokens=%d completion_tokens=%d tau=%.2f accepted_prediction=%d "
             "latency_s=%.3f queued_s=%.3f finish=%s", job.id, job.user or "-", stats.method, prompt_tokens,
             len(result.token_ids), stats.mean_accepted_length, stats.prediction_accepted_tokens,
             end - job.submitted, (job.started or end) - job.submitted, finish_reason(result))
