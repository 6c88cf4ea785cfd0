"""One generation's request, checked once: :class:`GenerationRequest`.

Every check of what a caller may ask lives here, and a request is checked and prepared once: its
prompt tokenized (a chat's template rendered once), its tools checked and its output grammar
compiled once (:mod:`specwise.output`), its drafter chosen, its sampling settings validated. The
loop then takes the request unchanged (:func:`run_request`). :func:`specwise.generate` builds one
from its keywords (:func:`build_request`); the server builds one from an HTTP body through the
same steps (:mod:`specwise.serve.requests`), adding only what HTTP needs (status codes, the field
an error names, its own limits).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from specwise.checks import check_int
from specwise.drafters import Drafter
from specwise.drafters.building import request_drafter
from specwise.drafters.prediction import PredictionDrafter, prediction_ids
from specwise.engine.load import BatchLoad, LoadShare
from specwise.engine.logprobs import MAX_TOP_LOGPROBS
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.token_ids import check_token_ids
from specwise.engine.types import GenerationResult
from specwise.errors import ConfigError, PromptError
from specwise.output import OutputRules, check_output, with_tool_calls
from specwise.targets.measured import observed_costs, verify_costs

#: how a request sizes each step's drafts (``draft_budget``)
DRAFT_BUDGETS = ("measured", "fixed")


@dataclass(frozen=True)
class GenerationRequest:
    """A checked generation, ready to run; built by :func:`build_request` (or the server's
    ``prepare``) and never changed after.

    Attributes:
        prompt_ids: ``[P]`` long on the target's device, P >= 1 (a chat: its template's tokens).
        max_new_tokens: the most new tokens, >= 1; prompt + this fits the target's context.
        sampling: the sampling settings (greedy at temperature 0).
        drafter: the drafter that proposes (a prediction is added at run time).
        output: the checked tools and compiled grammar (:class:`specwise.output.OutputRules`).
        seed: the sampling RNG's seed, or ``None``.
        stop: stop strings. include_stop: whether the text keeps the one that ended it.
        eos_token_ids: the tokens that end the generation (``None``: the target's own; a chat adds
            its template's end of turn; ``ignore_eos`` leaves none).
        logprobs: ``None``, or the number of alternatives per token to report (0 .. 20).
        prediction_ids: Predicted Outputs' ``[K]`` long token ids, or ``None``.
        draft_budget: ``"measured"`` or ``"fixed"`` (:data:`DRAFT_BUDGETS`).
    """

    prompt_ids: torch.Tensor
    max_new_tokens: int
    sampling: SamplingConfig
    drafter: Drafter
    output: OutputRules = OutputRules()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop: bool = True
    eos_token_ids: frozenset[int] | None = None
    logprobs: int | None = None
    prediction_ids: torch.Tensor | None = None
    draft_budget: str = "measured"

    @property
    def prompt_tokens(self) -> int:
        """P, the prompt's length in tokens."""
        return int(self.prompt_ids.numel())


def build_request(
    target,
    prompt: str | list[int] | tuple[int, ...] | torch.Tensor | None = None,
    *,
    messages: Sequence[dict[str, Any]] | None = None,
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict | None = None,
    parallel_tool_calls: bool = True,
    method: str = "ar",
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    include_stop: bool = True,
    prediction: str | Sequence[int] | None = None,
    ignore_eos: bool = False,
    response_format: Mapping[str, Any] | None = None,
    logprobs: int | None = None,
    draft_budget: str = "measured",
    **method_options: Any,
) -> GenerationRequest:
    """Check a generation's keywords (as :func:`specwise.generate` takes them) and prepare it once.

    Returns:
        the :class:`GenerationRequest`.

    Raises:
        as :func:`specwise.generate`.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, repetition_penalty)
    output = check_output(target, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                          response_format=response_format, chat=messages is not None)
    settings = check_settings(seed=seed, stop=stop, include_stop=include_stop, ignore_eos=ignore_eos,
                              draft_budget=draft_budget)
    check_max_new_tokens(max_new_tokens)
    prompt_ids, eos = prompt_of(target, prompt, messages, output.tools)
    check_context(target, prompt_ids.numel(), max_new_tokens)  # before a drafter's weights are read
    drafter = request_drafter(target, method, drafter, method_options)
    return finish_request(target, prompt_ids, eos, drafter, sampling, output, settings, logprobs, prediction,
                          ignore_eos=ignore_eos, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class Settings:
    """The checked plain settings of a request (see :class:`GenerationRequest`)."""

    seed: int | None
    stop: tuple[str, ...]
    include_stop: bool
    draft_budget: str


def check_settings(*, seed=None, stop=(), include_stop=True, ignore_eos=False,
                   draft_budget="measured") -> Settings:
    """Check the settings that need no target.

    Raises:
        ConfigError: a bad seed, stop strings, flag or ``draft_budget``.
    """
    check_seed(seed)
    stop = check_stop_strings(stop)
    for name, value in (("include_stop", include_stop), ("ignore_eos", ignore_eos)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}.")
    if draft_budget not in DRAFT_BUDGETS:
        raise ConfigError(f"draft_budget is one of {', '.join(map(repr, DRAFT_BUDGETS))}, got {draft_budget!r}.")
    return Settings(seed, stop, include_stop, draft_budget)


def finish_request(target, prompt_ids: torch.Tensor, eos: frozenset[int] | None, drafter: Drafter,
                   sampling: SamplingConfig, output: OutputRules, settings: Settings, logprobs: int | None,
                   prediction: str | Sequence[int] | None, *, ignore_eos: bool,
                   max_new_tokens: int) -> GenerationRequest:
    """The request from its checked parts, once the prompt's length is known.

    Raises:
        PromptError: prompt + ``max_new_tokens`` beyond the target's context; a bad prediction.
        ConfigError: a bad ``logprobs``.
    """
    check_logprobs(logprobs)
    check_context(target, prompt_ids.numel(), max_new_tokens)
    predicted = None if prediction is None else prediction_ids(target, prediction)
    return GenerationRequest(prompt_ids, max_new_tokens, sampling, drafter, output, settings.seed, settings.stop,
                             settings.include_stop, frozenset() if ignore_eos else eos, logprobs, predicted,
                             settings.draft_budget)


def run_request(target, request: GenerationRequest, *, streamer: Callable[[list[int]], None] | None = None,
                text_streamer: Callable[[str], None] | None = None,
                load: LoadShare | None = None) -> GenerationResult:
    """Run a checked request on ``target`` (the one it was built for) through the decoding loop.

    Args:
        streamer, text_streamer, load: as :func:`specwise.generate` takes them.

    Returns:
        the :class:`GenerationResult`, with the tool calls its output holds.
    """
    generator = None
    if not request.sampling.is_greedy or request.seed is not None:
        generator = torch.Generator(device=target.device)
        if request.seed is None:
            generator.seed()
        else:
            generator.manual_seed(request.seed)
    running = request.drafter
    if request.prediction_ids is not None:
        running = PredictionDrafter(running, request.prediction_ids,
                                    torch.tensor(sorted(target.eos_token_ids), dtype=torch.long))
    own = load is None and request.draft_budget == "measured" and getattr(running, "method", None) != "ar"
    if own:  # a batch of one: the same cost model sizes a lone generation's drafts
        if hasattr(request.drafter, "calibrate"):  # auto measures its candidates once per regime, alone
            request.drafter.calibrate(request.sampling)
        load = BatchLoad(verify_costs(target), observed=observed_costs(target)).join()
    try:
        result = speculative_generate(
            target, running, request.prompt_ids, max_new_tokens=request.max_new_tokens, sampling=request.sampling,
            generator=generator, stop_strings=request.stop, streamer=streamer, text_streamer=text_streamer,
            eos_token_ids=request.eos_token_ids, include_stop=request.include_stop, grammar=request.output.grammar,
            logprobs=request.logprobs, load=load,
        )
    finally:
        if own:
            load.leave()
    if request.prediction_ids is not None:
        result.stats.prediction_accepted_tokens = running.accepted_tokens
        result.stats.prediction_rejected_tokens = running.rejected_tokens
    return with_tool_calls(target, result, request.output.schemas)


def prompt_of(target, prompt=None, messages=None, tools: list[dict] | None = None
              ) -> tuple[torch.Tensor, frozenset[int] | None]:
    """A request's prompt as token ids, and the tokens that end it (a chat's: the target's EOS and
    its template's end of turn; a plain prompt's: ``None``, the target's own).

    Returns:
        ``([P] long on the target's device, end tokens or None)``.

    Raises:
        PromptError: both or neither of ``prompt`` and ``messages``; what :func:`encode_prompt`
            and the target's ``encode_chat`` raise.
    """
    if (prompt is None) == (messages is None):
        raise PromptError("give either a prompt or chat messages, not both." if prompt is not None
                          else "give a prompt (text or token ids) or chat messages.")
    if messages is None:
        return encode_prompt(target, prompt), None
    return target.encode_chat(messages, tools), target.eos_token_ids | target.end_of_turn_ids


def check_logprobs(logprobs) -> None:
    """Refuse a ``logprobs`` that is not ``None`` or an integer in 0 .. 20.

    Raises:
        ConfigError: naming the value.
    """
    check_int("logprobs", logprobs, 0, optional=True)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise ConfigError(f"logprobs takes at most {MAX_TOP_LOGPROBS} alternatives per token, got {logprobs}.")


def check_seed(seed) -> None:
    """Refuse a seed that ``torch.Generator.manual_seed`` cannot take.

    Raises:
        ConfigError: ``seed`` is neither ``None`` nor an integer in ``[0, 2**64)``.
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        raise ConfigError(f"seed must be an integer in [0, 2**64), got {seed!r}.")


def check_stop_strings(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of stop strings (one string is one stop string).

    Raises:
        ConfigError: ``stop`` is not a string or a sequence of non-empty, valid Unicode strings.
    """
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}.")
    if any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError("stop strings must be non-empty strings.")
    for s in stop:
        check_text("a stop string", s, ConfigError)
    return tuple(stop)


def check_text(what: str, text: str, error: type[Exception] = PromptError) -> None:
    """Refuse text that no tokenizer can take: a lone surrogate (what invalid UTF-8 bytes on a
    command line become).

    Raises:
        PromptError (or ``error``): ``text`` is not encodable as UTF-8.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not valid UTF-8 text: it holds the lone surrogate U+{ord(text[exc.start]):04X} "
                    f"at character {exc.start} (invalid bytes in the input).") from None


def check_max_new_tokens(max_new_tokens) -> None:
    """Refuse a ``max_new_tokens`` that is not an integer >= 1.

    Raises:
        ConfigError: naming the value.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")


def check_context(target, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt of ``prompt_tokens`` tokens plus ``max_new_tokens`` new ones beyond the
    target's context.

    Raises:
        PromptError: naming both sizes and the context's.
    """
    if prompt_tokens + max_new_tokens > target.max_context:
        raise PromptError(f"the prompt has {prompt_tokens} tokens and {max_new_tokens} new tokens were asked for, "
                          f"but the target's context holds {target.max_context} tokens.")


def encode_prompt(target, prompt) -> torch.Tensor:
    """A prompt as :func:`specwise.generate` reads it: text tokenized with the target's special
    prefix (BOS), or token ids checked.

    Args:
        prompt: text, a list or tuple of ``int``, or a 1-D integer tensor; nothing else.

    Returns:
        ``[P]`` long on the target's device, P >= 1.

    Raises:
        PromptError: empty, not valid UTF-8, another type or shape (:func:`check_token_ids`), or
            ids outside the vocabulary.
    """
    if isinstance(prompt, str):
        check_text("the prompt", prompt)
        if not prompt.strip():
            raise PromptError("the prompt is empty.")
        ids = target.encode(prompt)
    else:
        ids = check_token_ids(prompt, "the prompt", target.vocab_size).to(target.device)
    if ids.numel() == 0:
        raise PromptError("the prompt is empty.")
    return ids


#: the keywords :func:`build_request` takes itself (the rest are the method's options)
REQUEST_ARGS = frozenset(inspect.signature(build_request).parameters) - {"target", "method_options"}
