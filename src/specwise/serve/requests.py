"""A request's path before it runs, as plain functions: check it once against what the server
serves and its limits, tokenize it, and build the generation it asks for (docs/serve.md).

Nothing here needs a running server: :func:`prepare` takes a parsed request body
(:mod:`specwise.serve.protocol`) and returns the :class:`Prepared` generation, or raises the
:class:`~specwise.serve.protocol.ApiError` the client gets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specwise.drafters.base import METHODS, Drafter
from specwise.drafters.building import shared_drafter
from specwise.engine.sampling import SamplingConfig
from specwise.errors import PromptError, SpecwiseError
from specwise.output import OutputRules, check_output
from specwise.request import GenerationRequest, check_settings, finish_request, prompt_of
from specwise.serve.options import check_request_options
from specwise.serve.protocol import ApiError
from specwise.targets.tool_calls import ToolError


@dataclass(frozen=True)
class Limits:
    """What a server serves and allows (the parts of its config a request is checked against).

    Attributes:
        model: the model id clients name.
        default_method: the method of a request that names none.
        methods: the methods a request may choose.
        max_tokens_cap: the most new tokens a request may ask for (and the default for chat).
        max_prompt_tokens: the longest prompt accepted; ``None``: the target's context.
        max_messages: the most chat messages in one request.
        draft_budget: how a generation run alone sizes its drafts (:data:`specwise.request.DRAFT_BUDGETS`).
    """

    model: str
    default_method: str
    methods: tuple[str, ...]
    max_tokens_cap: int
    max_prompt_tokens: int | None
    max_messages: int
    draft_budget: str = "measured"


@dataclass(frozen=True)
class Prepared:
    """A checked request, ready to run.

    Attributes:
        request_id: ``chatcmpl-...`` or ``cmpl-...``.
        request: the checked generation (:class:`specwise.request.GenerationRequest`): prompt ids,
            sampling, stop strings, the compiled grammar and tools, the drafter, ``max_new_tokens``.
        method, options: the method the request chose and its options.
    """

    request_id: str
    request: GenerationRequest
    method: str
    options: dict[str, Any]

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens (chat: as the template renders it)."""
        return self.request.prompt_tokens


def check_request(body, chat: bool, limits: Limits) -> tuple[str, dict[str, Any]]:
    """The checks that need no tokenizer: the model, the method and its options, the prediction.

    Returns:
        ``(method, options)``.

    Raises:
        ApiError: 404 for another model; 400 naming the field otherwise.
    """
    if body.model != limits.model:
        raise ApiError(404, f"the model {body.model!r} is not served here; this server serves {limits.model!r}.",
                       "model", kind="not_found_error")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream=true.", "stream_options")
    spec = body.speculative
    if spec is not None and spec.origins and not body.stream:
        raise ApiError(400, "speculative.origins needs stream=true (the origins come in the stream's chunks).",
                       "speculative.origins")
    method = (spec.method if spec and spec.method else None) or limits.default_method
    if method not in limits.methods:
        raise ApiError(400, f"method {method!r} is not loaded on this server (loaded: {', '.join(limits.methods)}).",
                       "speculative.method")
    options = dict(spec.options) if spec else {}
    check_request_options(method, options)
    if body.prediction is not None and not body.prediction.text.strip():
        raise ApiError(400, "the prediction is empty; leave it out or give the text the output should repeat.",
                       "prediction")
    if chat and len(body.messages) > limits.max_messages:
        raise ApiError(413, f"{len(body.messages)} messages exceed this server's limit of {limits.max_messages}.",
                       "messages")
    return method, options


def sampling_of(body) -> SamplingConfig:
    """The request's sampling settings (``top_p`` 0 keeps only the most likely token).

    Raises:
        ApiError: 400 for settings the sampler refuses.
    """
    try:
        return SamplingConfig(float(body.temperature), 1 if body.top_p == 0 else 0, float(body.top_p) or 1.0)
    except SpecwiseError as exc:
        raise ApiError(400, str(exc)) from None


def check_output_format(target, body, chat: bool) -> OutputRules:
    """Check the request's tools and compile the grammar its output takes (its ``response_format``,
    or the calls' grammar of a required or named ``tool_choice``), once (:func:`specwise.output.check_output`).
    Slow the first time (the grammar engine reads the tokenizer): run it off the event loop.

    Raises:
        ApiError: 400 naming ``tools``, ``tool_choice`` or ``response_format``: bad tools, a choice
            naming no tool, tools with a response format or on a template that cannot render them, a
            bad format, schema, regex or grammar.
    """
    tools = body.tool_kwargs if chat else {}
    try:
        return check_output(target, tools=tools.get("tools"), tool_choice=tools.get("tool_choice"),
                            parallel_tool_calls=tools.get("parallel_tool_calls", True),
                            response_format=body.response_format, chat=True)
    except ToolError as exc:
        raise ApiError(400, str(exc), "tool_choice" if str(exc).startswith("tool_choice") else "tools") from None
    except PromptError as exc:  # tools for a template that cannot render them
        raise ApiError(400, str(exc), "tools") from None
    except SpecwiseError as exc:
        raise ApiError(400, str(exc), "response_format" if body.response_format is not None else "tools") from None


def tokenize(target, body, chat: bool, tools: list[dict] | None = None) -> tuple[torch.Tensor, frozenset[int] | None]:
    """The prompt's token ids (a chat: through the template, ``tools`` rendered) and the tokens
    that end it (:func:`specwise.request.prompt_of`). Slow (a tokenizer, a chat template): run it
    off the event loop.

    Raises:
        ApiError: 400 for a prompt or messages the target refuses (no chat template included).
    """
    try:
        if chat:
            return prompt_of(target, messages=[m.as_chat() for m in body.messages], tools=tools)
        return prompt_of(target, body.prompt)
    except SpecwiseError as exc:
        message = str(exc)
        if chat and "chat template" in message:  # one sentence, with where to go instead
            message = message.removesuffix(".").removesuffix("; pass a text prompt")
            message += "; send a text prompt to /v1/completions instead."
        raise ApiError(400, message, "messages" if chat else "prompt") from None


def token_budget(body, chat: bool, prompt_tokens: int, context: int, limits: Limits) -> int:
    """The new tokens the request gets: what it asked for, else (chat) the cap and what the context leaves.

    Raises:
        ApiError: 413 for a prompt over the limit; 400 for ``max_tokens`` over the cap or the context.
    """
    field = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    where = "messages" if chat else "prompt"
    limit = limits.max_prompt_tokens or context
    if prompt_tokens > limit:
        raise ApiError(413, f"the prompt has {prompt_tokens} tokens; this server accepts at most {limit}.", where)
    asked = body.token_limit if chat else body.max_tokens
    room = context - prompt_tokens
    if asked is not None and asked > limits.max_tokens_cap:
        raise ApiError(400, f"{field} is {asked}; this server allows at most {limits.max_tokens_cap}.", field)
    if asked is not None and asked > room:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens and {field} is {asked}, but the target's "
                            f"context holds {context} tokens.", field)
    if room < 1:
        raise ApiError(400, f"the prompt fills the target's context of {context} tokens.", where)
    return asked if asked is not None else min(limits.max_tokens_cap, room)


def prepare(target, body, chat: bool, limits: Limits, tenant: str = "",
            drafter_for: Callable[[str, dict[str, Any]], Drafter] | None = None) -> Prepared:
    """Check ``body`` once, tokenize it and build its generation (tokenizes: call it off the event
    loop). Every check of the generation itself is :mod:`specwise.request`'s, run once; this adds
    the server's limits and the HTTP status and field of each refusal.

    Args:
        target: the served :class:`specwise.targets.hf.Target`.
        body: a parsed :class:`~specwise.serve.protocol.CompletionRequest` or
            :class:`~specwise.serve.protocol.ChatRequest`.
        chat: whether ``body`` is a chat request.
        limits: the server's :class:`Limits`.
        tenant: whose request it is (the API key's, :func:`specwise.serve.app.tenant_of`; ``""``
            without keys): a method that drafts from earlier requests' text draws only on this
            tenant's (its ``scope`` option).
        drafter_for: the drafter for a method and options (the worker's, built at start); default
            the target's kept drafter (:func:`specwise.drafters.building.shared_drafter`).

    Raises:
        ApiError: the status and field the client is told.
    """
    method, options = check_request(body, chat, limits)
    if tenant and "scope" in METHODS.get(method).option_names:  # no tenant: the default scope, options unchanged
        options["scope"] = tenant
    sampling = sampling_of(body)
    output = check_output_format(target, body, chat)
    prompt_ids, eos = tokenize(target, body, chat, output.tools)
    max_new_tokens = token_budget(body, chat, int(prompt_ids.numel()), target.max_context, limits)
    try:
        settings = check_settings(seed=body.seed, stop=body.stop_strings, include_stop=False,
                                  draft_budget=limits.draft_budget)
        drafter = drafter_for(method, options) if drafter_for else shared_drafter(target, method, **options)
        request = finish_request(target, prompt_ids, eos, drafter, sampling, output, settings, body.logprob_count,
                                 body.prediction.text if body.prediction is not None else None, ignore_eos=False,
                                 max_new_tokens=max_new_tokens)
    except SpecwiseError as exc:
        raise ApiError(400, str(exc)) from None
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    return Prepared(request_id, request, method, options)
