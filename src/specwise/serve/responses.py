"""A finished or running generation as OpenAI's response shapes: one JSON body, or Server-Sent
Events (one chunk per committed step), with ``usage`` and a ``speculative_decoding`` summary."""

from __future__ import annotations

import json
import logging
import time
from typing import AsyncIterator, Callable

from fastapi.sse import format_sse_event

from specwise.serve.protocol import finish_reason, now, speculative_decoding, usage
from specwise.targets.tool_calls import CALL_OPEN, held_back

log = logging.getLogger("specwise.serve")


def _json(data) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def logprobs_body(result, chat: bool, token_text: Callable[[int], tuple[str, bytes]]) -> dict | None:
    """OpenAI's ``logprobs`` of a choice from ``result.logprobs`` (``None`` when not asked for): chat's
    ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``, or the completions API's
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``. The EOS that ended the
    generation is left out, as it is from the text.

    Args:
        token_text: one token's ``(text, bytes)``: the bytes are the token's own, so a token that
            holds part of a UTF-8 character has the bytes of that part (its text shows U+FFFD).
    """
    entries = result.logprobs
    if entries is None:
        return None
    if result.stop_reason == "eos" and entries:
        entries = entries[:-1]

    def text(token: int) -> str:
        return token_text(token)[0]

    def value(logprob: float) -> float:
        return max(logprob, -9999.0)  # JSON has no -inf; OpenAI reports -9999 for tokens it rules out

    if chat:
        def item(token: int, logprob: float) -> dict:
            piece, raw = token_text(token)
            return {"token": piece, "logprob": value(logprob), "bytes": list(raw)}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    pieces = [text(e.token_id) for e in entries]
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return {"tokens": pieces, "token_logprobs": [value(e.logprob) for e in entries],
            "top_logprobs": [{text(t): value(lp) for t, lp in e.top} for e in entries] if any(e.top for e in entries)
            else None, "text_offset": offsets}


def completion_body(job, result, model: str, chat: bool, prompt_tokens: int,
                    token_text: Callable[[int], tuple[str, bytes]]) -> dict:
    """The non-streamed response to ``job``, whose generation returned ``result`` (``token_text``:
    one token's text and bytes, for log-probabilities)."""
    text = "".join(job.pieces)
    reason = finish_reason(result)
    logprobs = logprobs_body(result, chat, token_text)
    if chat:
        message = {"role": "assistant", "content": text}
        if result.tool_calls:
            # the text before the first call; None when the template's markers are special tokens the
            # decoded text leaves out (then the calls cannot be told from the text)
            at = text.find(CALL_OPEN)
            message = {"role": "assistant", "content": text[:at].strip() or None if at >= 0 else None,
                       "tool_calls": [call.to_openai() for call in result.tool_calls]}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"id": job.id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, result),
            "speculative_decoding": speculative_decoding(result.stats)}


async def stream_events(job, body, chat: bool, model: str, prompt_tokens: int, on_done,
                        token_text: Callable[[int], tuple[str, bytes]]) -> AsyncIterator[bytes]:
    """The SSE chunks of ``job`` as its events arrive, then ``data: [DONE]``; an error event (the
    time limit, a shutdown) ends the stream the same way.

    Args:
        job: the running :class:`~specwise.serve.worker.Job`. body: the parsed request.
        on_done: called with the result when the generation finishes (metrics, the log line).
        token_text: one token's text and bytes; log-probabilities asked for come whole in the chunk that
            carries the finish reason (a client that joins every chunk's list gets them all).

    Returns (yields):
        each chunk as bytes. Whether the stream reached its end is ``job``'s to tell: the caller
        withdraws the job whatever happened.
    """
    created, kind_name = now(), "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if body.include_usage else {}

    steps: list[dict] = []  # the origins of tokens whose text has not been sent yet (speculative.origins)

    def chunk(choices: list) -> bytes:
        data = {"id": job.id, "object": kind_name, "created": created, "model": model, "choices": choices, **extra}
        if steps:
            data["specwise"] = {"steps": steps[:]}
            steps.clear()
        return format_sse_event(data_str=_json(data))

    def choice(text: str | None, reason: str | None, role: bool = False, logprobs: dict | None = None) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}

    watch = CallWatch() if chat and body.tools and body.tool_choice != "none" else None
    if chat:
        yield chunk([choice(None, None, role=True)])
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            text, step = value
            if step is not None and watch is None:  # tool calls' text is never shown, nor its origins
                steps.append(step)
            text = watch.feed(text) if watch else text
            if text:
                yield chunk([choice(text, None)])
            continue
        if kind == "error":
            yield format_sse_event(data_str=_json(value.body()))
            break
        on_done(value)
        if value.tool_calls:
            calls = [call.to_openai(i) for i, call in enumerate(value.tool_calls)]
            yield chunk([{"index": 0, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}])
        elif watch and watch.pending:
            yield chunk([choice(watch.pending, None)])
        yield chunk([choice(None, finish_reason(value), logprobs=logprobs_body(value, chat, token_text))])
        if body.include_usage:
            data = {"id": job.id, "object": kind_name, "created": created, "model": model, "choices": [],
                    "usage": usage(prompt_tokens, value), "speculative_decoding": speculative_decoding(value.stats)}
            yield format_sse_event(data_str=_json(data))
        break
    yield format_sse_event(data_str="[DONE]")


class CallWatch:
    """Streamed text with tool calls held back: what may still open a ``<tool_call>`` block waits
    for the next piece, and nothing from the first block on is sent as text (it becomes the
    calls, or, if they are malformed, the text sent last)."""

    def __init__(self) -> None:
        self.pending, self.opened = "", False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held back) that can be sent as content now."""
        self.pending += text
        if self.opened:
            return ""
        at = self.pending.find(CALL_OPEN)
        if at >= 0:
            self.opened = True
            sent, self.pending = self.pending[:at], self.pending[at:]
            return sent
        cut = len(self.pending) - held_back(self.pending)
        sent, self.pending = self.pending[:cut], self.pending[cut:]
        return sent


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
