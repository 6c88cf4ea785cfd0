"""The OpenAI request and response shapes the server speaks, and its error JSON.

Requests are pydantic models that forbid unknown fields: a parameter the server does not implement
is refused with a 400 naming it, never silently ignored. Parameters OpenAI defines but the server
does not implement (``n`` > 1, penalties, ``echo``, ``best_of``) are accepted only at their no-op
values.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from specwise.engine.logprobs import MAX_TOP_LOGPROBS
from specwise.engine.sampling import TEMPERATURE_RANGE

#: at most this many stop strings per request (OpenAI's limit)
MAX_STOP_STRINGS = 4


class ApiError(Exception):
    """An error answered with OpenAI's error JSON.

    Args:
        status: the HTTP status.
        message: one sentence for the client.
        param: the request field at fault, if any.
        kind: OpenAI's ``type`` (``invalid_request_error``, ``authentication_error``, ...).
        headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.kind, self.param)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


#: the server's range of ``temperature``: 0 (greedy), or OpenAI's upper bound of 2 above the smallest
#: temperature the sampler takes (:data:`specwise.engine.sampling.TEMPERATURE_RANGE`)
TEMPERATURE = (TEMPERATURE_RANGE[0], 2)
#: a request's temperature when it names none (OpenAI's default)
DEFAULT_TEMPERATURE = 1.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class PredictionContent(_Strict):
    """OpenAI's ``prediction``: ``{"type": "content", "content": str | [text parts]}``."""

    type: Literal["content"]
    content: StrictStr | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


OptionValue = StrictBool | StrictInt | StrictFloat | StrictStr


class Speculative(_Strict):
    """The ``speculative`` extension (``extra_body``): a method the server loaded, and its options."""

    method: StrictStr | None = None
    options: dict[str, OptionValue] = Field(default_factory=dict)
    # each streamed chunk also says where its tokens came from (its ``specwise`` field, docs/serve.md)
    origins: StrictBool = False


class _Request(_Strict):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = DEFAULT_TEMPERATURE
    top_p: StrictFloat | StrictInt = 1.0
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: StrictFloat | StrictInt = 0.0
    presence_penalty: StrictFloat | StrictInt = 0.0
    user: StrictStr | None = None
    prediction: PredictionContent | None = None
    response_format: dict[str, Any] | None = None  # checked and compiled by the grammar module
    speculative: Speculative | None = None

    @field_validator("echo", "suffix", check_fields=False)
    @classmethod
    def _unsupported(cls, value):
        if value:
            raise ValueError("is not supported by this server")
        return value

    @field_validator("top_logprobs", check_fields=False)
    @classmethod
    def _top_logprobs(cls, value):
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_TOP_LOGPROBS}")
        return value

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _positive(cls, value):
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        low, high = TEMPERATURE
        if not (value == 0 or low <= value <= high):
            raise ValueError(f"must be 0 (greedy) or between {low:g} and {high:g}")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value):
        if not 0 <= value <= 1:
            raise ValueError("must be between 0 and 1 (0 keeps only the most likely token)")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError("only n=1 is supported; send one request per completion")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        if value is not None and not -(2**63) <= value < 2**64:
            raise ValueError("must be an integer in [-2**63, 2**64)")
        return None if value is None else value % 2**64  # a negative seed is its two's complement

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value != 0:
            raise ValueError("is not supported (a penalty changes the target's distribution); leave it at 0")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("one prompt per request is supported; send a request per prompt")
            return value[0]
        return value

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_TOP_LOGPROBS} (the alternatives listed per token)")
        return value

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to report with log-probabilities, or ``None`` for none."""
        return self.logprobs

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value):
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as a string


class ToolCallItem(_Strict):
    """A call in an assistant message of the history."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None

    @property
    def text(self) -> str | None:
        if self.content is None:
            return None
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_chat(self) -> dict[str, Any]:
        """The message as :func:`specwise.targets.chat.check_messages` takes it."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by specwise.targets.tool_calls

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Request):
    """``POST /v1/chat/completions``: messages through the target's chat template."""

    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value):
        if not value:
            raise ValueError("must hold at least one message")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs=true")
        return value

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token to report with log-probabilities, or ``None`` for none."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_kwargs(self) -> dict[str, Any]:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as :func:`specwise.generate` takes them."""
        if self.tools is None and self.tool_choice is None:
            return {}
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls}

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def usage(prompt_tokens: int, result) -> dict:
    """OpenAI's ``usage``, with the Predicted Outputs counts."""
    completion = len(result.token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens_details": {
            "accepted_prediction_tokens": result.stats.prediction_accepted_tokens,
            "rejected_prediction_tokens": result.stats.prediction_rejected_tokens,
        },
    }


def speculative_decoding(stats) -> dict:
    """What the speculation did: method (and, run by run, the methods ``auto`` ran), τ, acceptance
    (overall and by draft position), counts, times (s)."""
    return {
        "method": stats.method,
        "method_steps": stats.method_steps,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "acceptance_by_position": [round(x, 4) for x in stats.acceptance_by_position],
        "target_forwards": stats.target_forwards,
        "drafts": stats.drafted_by_position[0] if stats.drafted_by_position else 0,  # steps that verified drafts
        "draft_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "draft_time_s": round(stats.draft_time_s, 4),
        "verify_time_s": round(stats.verify_time_s, 4),
        # the load rule (docs/serve.md): steps run beside other generations with a capped draft budget
        "capped_steps": len(stats.draft_budgets),
        "mean_draft_budget": round(sum(stats.draft_budgets) / len(stats.draft_budgets), 3) if stats.draft_budgets else None,
    }


def finish_reason(result) -> str:
    """OpenAI's ``finish_reason``: ``tool_calls`` (the output is valid calls), ``stop`` (EOS, end
    of turn, a stop string, a complete grammar) or ``length``."""
    if getattr(result, "tool_calls", None):
        return "tool_calls"
    return "length" if result.stop_reason == "length" else "stop"


def now() -> int:
    return int(time.time())
