"""The public entry point: :func:`generate`."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from specwise.checks import check_int
from specwise.drafters import METHODS, Drafter
from specwise.drafters.base import check_engine, warn_renamed
from specwise.drafters.checkpoint import is_checkpoint, read_config, shipped_drafter
from specwise.engine.grammar import Grammar, GrammarCompiler, grammar_source
from specwise.engine.load import BatchLoad, LoadShare
from specwise.engine.logprobs import MAX_TOP_LOGPROBS
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.token_ids import check_token_ids
from specwise.engine.types import GenerationResult
from specwise.errors import ConfigError, DrafterError, PromptError
from specwise.methods.prediction import PredictionDrafter, prediction_ids
from specwise.targets.engine_choice import check_engine_name
from specwise.targets.measured import verify_costs
from specwise.targets.tool_calls import (
    ToolError,
    call_grammar,
    call_markers,
    check_tools,
    chosen_tool,
    parse_tool_calls,
)

#: drafters :func:`generate` keeps per target for the option sets it was called with (least
#: recently used dropped): a drafter is shared, so repeated calls reuse one
KEPT_DRAFTERS = 8
#: compiled grammars :func:`compile_response_format` keeps per target (least recently used dropped)
KEPT_GRAMMARS = 32
#: how :func:`generate` sizes each step's drafts (``draft_budget``)
DRAFT_BUDGETS = ("measured", "fixed")


def build_drafter(target, method: str, **options: Any) -> Drafter:
    """Instantiate the drafter registered as ``method`` with its typed options.

    The drafter holds no per-generation state: any number of :func:`generate` calls, threads
    included, may use it at once. Trained weights are read once per target and shared by every
    drafter built for it. :func:`generate` refuses the drafter with another target.

    Raises:
        DrafterError: unknown method (the message lists the available ones) or a bad drafter.
        ConfigError: an option the method does not take, or out of range (a drafter path with a
            method that uses none included).
    """
    spec, config = spec_and_config(method, **options)
    check_engine(target, spec.factory)  # before any weights are read
    drafter = spec.factory(target, config)
    check_engine(target, drafter)
    return drafter


def shared_drafter(target, method: str, **options: Any) -> Drafter:
    """The drafter for ``method`` with ``options`` kept on ``target`` (built on first use; the
    :data:`KEPT_DRAFTERS` most recently used option sets are kept), so repeated calls cost no rebuild.

    Raises:
        as :func:`build_drafter`.
    """
    spec, config = spec_and_config(method, **options)
    kept = target.__dict__.setdefault("_kept_drafters", OrderedDict())
    lock = target.__dict__.setdefault("_kept_drafters_lock", threading.Lock())
    key = (method, config)
    with lock:
        drafter = kept.pop(key, None)
        if drafter is None:
            check_engine(target, spec.factory)
            drafter = spec.factory(target, config)
            check_engine(target, drafter)
        kept[key] = drafter
        while len(kept) > KEPT_DRAFTERS:
            kept.popitem(last=False)
    return drafter


def engine_for(engine: str, method: str, config, target: str) -> str:
    """The engine to load ``target`` on for ``method``: the one asked for, but ``auto`` never picks
    llama.cpp for a method that cannot run there (``draft`` with a trained draft-LM checkpoint, which
    shares the torch target's decoder layers)."""
    if check_engine_name(engine) is not None or method != "draft":
        return engine
    drafter = config.drafter_path or shipped_drafter(target, "draft")
    return "torch" if drafter is not None and is_checkpoint(drafter) else engine


def spec_and_config(method: str, **options: Any):
    """The registered method ``method`` and its typed config built from ``options``.

    Returns:
        ``(MethodSpec, MethodConfig)``.

    Raises:
        DrafterError: unknown method. ConfigError: an option the method does not take, or out of range.
    """
    spec = METHODS.get(method)
    if "drafter_path" in options and "drafter_path" not in spec.option_names:
        takers = ", ".join(s.name for s in METHODS.listed() if "drafter_path" in s.option_names)
        raise ConfigError(f"method {method!r} uses no trained drafter or draft model, but one was given "
                          f"({options['drafter_path']}); choose a method that does ({takers}).")
    return spec, spec.make_config(**options)


def load_drafter(path: str | Path, target, **options):
    """Build the drafter stored in ``path`` for ``target``.

    Args:
        path: a drafter directory (``config.json`` + ``model.safetensors``).
        target: the :class:`specwise.targets.hf.Target`.
        **options: the method's options (e.g. ``num_draft_tokens``; not ``drafter_path``, which is ``path``).

    Returns:
        a :class:`specwise.drafters.base.Drafter`.

    Raises:
        DrafterError: not a drafter, missing weights, or trained for another target.
        ConfigError: an option the method does not take.
    """
    config = read_config(path)
    spec = METHODS.get(config["method"])
    return spec.factory(target, spec.make_config(drafter_path=str(path), **options))


def generate(
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
    streamer: Callable[[list[int]], None] | None = None,
    text_streamer: Callable[[str], None] | None = None,
    include_stop: bool = True,
    prediction: str | Sequence[int] | None = None,
    ignore_eos: bool = False,
    response_format: Mapping[str, Any] | None = None,
    logprobs: int | None = None,
    load: LoadShare | None = None,
    draft_budget: str = "measured",
    **method_options: Any,
) -> GenerationResult:
    """Generate text with lossless speculative decoding.

    The output is what the target alone would produce: the same tokens under greedy decoding, the
    same distribution under sampling.

    Args:
        target: a :class:`specwise.targets.hf.Target` (see :func:`specwise.load_target`).
        prompt: text (tokenized with the target's tokenizer, BOS added), or token ids as a list or
            tuple of ``int`` or a 1-D integer tensor; any other type is refused, never converted.
        messages: instead of ``prompt``, a chat in OpenAI's shape (``[{"role": "user", "content":
            "..."}]``; roles system, user, assistant, tool), rendered by the target's own chat template
            with the assistant's turn opened; generation also ends at the template's end-of-turn token
            (Qwen's ``<|im_end|>``, Gemma's ``<end_of_turn>``), which ``text`` leaves out.
        tools: with ``messages``, OpenAI's tool definitions (``[{"type": "function", "function":
            {"name", "description", "parameters"}}]``), rendered by a chat template that writes calls
            as ``<tool_call>`` blocks (Qwen2.5's); valid calls come back as ``result.tool_calls``
            (:mod:`specwise.targets.tool_calls`).
        tool_choice: ``"auto"`` (the default: the model answers or calls, its calls parsed),
            ``"none"`` (the tools are not rendered), ``"required"`` or ``{"type": "function",
            "function": {"name": ...}}`` (the output is constrained to calls, of the named one only).
        parallel_tool_calls: whether a constrained output may hold several calls.
        method: a registered method name (``ar``, ``pld``, ``draft``, ...); ignored when
            ``drafter`` is given.
        drafter: an already built drafter (:func:`build_drafter`), reused across calls and threads
            (it holds no per-generation state); by default ``method``'s drafter with
            ``method_options``, kept on the target for the next call (:func:`shared_drafter`). The weights
            of a trained method are the method option ``drafter_path`` (``--drafter PATH``); a path
            given here is still read as that (deprecated).
        max_new_tokens: number of new tokens, >= 1 (fewer if an EOS or stop string comes first).
        temperature: 0 for greedy decoding.
        top_k: 0 = off. top_p: in (0, 1]. repetition_penalty: 1 = off.
        seed: seeds the sampling RNG (a ``torch.Generator`` on the target's device).
        stop: a stop string or several, matched on the new text decoded with special tokens (so
            ``"<|im_end|>"`` works); generation ends at the token that completes one, and ``text``
            ends right after it (it is kept unless ``include_stop=False``).
        streamer: called with each step's new token ids as they are committed.
        text_streamer: called with each new piece of text (``str``) as stop strings see it
            (special tokens kept, a final EOS left out); a tail that could still begin a stop
            string is held back until it cannot, so it never shows text past a stop string. The
            pieces add up to ``text`` unless special tokens were skipped from it.
        include_stop: keep the stop string that ended generation at the end of ``text`` and of the
            streamed text; ``False`` leaves it out (OpenAI's ``stop``), wherever it ends (inside a
            block of accepted draft tokens too). ``token_ids`` holds its tokens either way.
        ignore_eos: go on past end-of-sequence (and end-of-turn) tokens to ``max_new_tokens``, as
            benchmarks do to time a fixed number of tokens (llama.cpp's and vLLM's ``ignore_eos``).
        prediction: Predicted Outputs: text (or token ids) the output is expected to largely repeat,
            e.g. the code being edited. It becomes a second drafting source next to ``method``
            (:class:`specwise.methods.prediction.PredictionDrafter`); the output stays exactly the
            target's. ``stats.prediction_accepted_tokens`` / ``prediction_rejected_tokens`` count it.
        response_format: constrain the output (OpenAI's shapes): ``{"type": "json_object"}``,
            ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``, or
            ``{"type": "regex", "pattern": ...}`` / ``{"type": "grammar", "grammar": ..., "syntax":
            "lark" | "gbnf"}`` (:func:`specwise.engine.grammar.grammar_source`). The output is
            distributed exactly as the target's with the grammar's mask applied before the sampling
            options, under every method; it ends (``finish_reason == "stop"``) where the grammar is
            complete, or at ``max_new_tokens`` (then it need not parse).
        logprobs: ``None``, or give ``result.logprobs``: each new token's log-probability under the
            target (its log-softmax before the sampling options and the grammar), with this many of
            the most likely alternatives (0 .. 20), from the rows verification computed.
        load: this generation's seat in a batch of generations (:func:`specwise.many.generate_many`
            and the server hand one out): its draft budget per step follows the batch's load rule
            (:mod:`specwise.engine.load`); the output is the same.
        draft_budget: without ``load``, how many drafts each step verifies: ``"measured"`` (the
            default) sizes them by the cost model of :mod:`specwise.engine.load` as a batch of one
            (the target's v(n) measured once per target object, this generation's acceptance and
            drafting time measured as it runs, down to none); ``"fixed"`` verifies what the
            method's own options propose. The output is the same either way.
        **method_options: the method's options, e.g. ``num_draft_tokens=8``, ``drafter_path=PATH``.

    Returns:
        :class:`GenerationResult` with ``text``, ``token_ids``, ``stats`` (:class:`SpecStats`),
        ``finish_reason`` (``stop`` / ``length`` / ``eos``) and ``stop_string``.

    Thread safety: a ``Target`` and a drafter may serve concurrent calls (each call owns its KV
    cache, its drafting state and its RNG).

    Raises:
        PromptError: empty prompt, text that is not valid UTF-8, token ids of another type or
            shape than those above or outside the vocabulary, or prompt + ``max_new_tokens`` beyond the
            target's context; both or neither of ``prompt`` and ``messages``, malformed messages, or
            messages for a target without a chat template.
        ConfigError: options out of range or of the wrong type (``stop``, ``seed`` included);
            a bad ``response_format``, schema, regex or grammar (:class:`~specwise.engine.grammar.GrammarError`);
            bad ``tools`` or ``tool_choice``, tools without messages, or tools with a response format
            (:class:`~specwise.targets.tool_calls.ToolError`).
        DrafterError: unknown method, a bad drafter, or a drafter built for another target.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, repetition_penalty)
    check_int("logprobs", logprobs, 0, optional=True)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise ConfigError(f"logprobs takes at most {MAX_TOP_LOGPROBS} alternatives per token, got {logprobs}.")
    render_tools, schemas, response_format = tool_setup(tools, tool_choice, parallel_tool_calls, response_format,
                                                        messages is not None, target)
    grammar = compile_response_format(target, response_format)
    check_seed(seed)
    stop = check_stop_strings(stop)
    if not isinstance(include_stop, bool):
        raise ConfigError(f"include_stop must be True or False, got {include_stop!r}.")
    if not isinstance(ignore_eos, bool):
        raise ConfigError(f"ignore_eos must be True or False, got {ignore_eos!r}.")
    if isinstance(drafter, (str, os.PathLike)):
        warn_renamed("generate", "drafter=PATH", "drafter_path=PATH")
        if "drafter_path" in method_options:
            raise ConfigError("give drafter_path or a path as drafter, not both.")
        method_options["drafter_path"] = os.fspath(drafter)
        drafter = None
    check_max_new_tokens(max_new_tokens)
    if draft_budget not in DRAFT_BUDGETS:
        raise ConfigError(f"draft_budget is one of {', '.join(map(repr, DRAFT_BUDGETS))}, got {draft_budget!r}.")
    if (prompt is None) == (messages is None):
        raise PromptError("give either a prompt or chat messages, not both." if prompt is not None
                          else "give a prompt (text or token ids) or chat messages.")
    eos_token_ids = None
    if messages is not None:
        prompt_ids = target.encode_chat(messages, render_tools)
        eos_token_ids = target.eos_token_ids | target.end_of_turn_ids
    else:
        prompt_ids = encode_prompt(target, prompt)
    if ignore_eos:
        eos_token_ids = frozenset()
    check_context(target, prompt_ids.numel(), max_new_tokens)
    if drafter is None:
        drafter = shared_drafter(target, method, **method_options)
    elif method_options:
        raise ConfigError("method options cannot be combined with an already built drafter.")
    elif getattr(drafter, "target", None) is not None and drafter.target is not target:
        raise DrafterError(f"this drafter was built for another target ({drafter.target.name}), not "
                           f"{target.name}; build one with specwise.build_drafter(target, ...).")
    else:
        check_engine(target, drafter)
    generator = None
    if not sampling.is_greedy or seed is not None:
        generator = torch.Generator(device=target.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    running = drafter
    if prediction is not None:
        running = PredictionDrafter(drafter, prediction_ids(target, prediction),
                                    torch.tensor(sorted(target.eos_token_ids), dtype=torch.long))
    own = load is None and draft_budget == "measured" and getattr(running, "method", None) != "ar"
    if own:  # a batch of one: the same cost model sizes a lone generation's drafts
        if hasattr(drafter, "calibrate"):  # auto measures its candidates once per regime, alone
            drafter.calibrate(sampling)
        load = BatchLoad(verify_costs(target)).join()
    try:
        result = speculative_generate(
            target, running, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
            generator=generator, stop_strings=stop, streamer=streamer, text_streamer=text_streamer,
            eos_token_ids=eos_token_ids, include_stop=include_stop, grammar=grammar, logprobs=logprobs, load=load,
        )
    finally:
        if own:
            load.leave()
    if prediction is not None:
        result.stats.prediction_accepted_tokens = running.accepted_tokens
        result.stats.prediction_rejected_tokens = running.rejected_tokens
    return with_tool_calls(target, result, schemas)


def tool_setup(tools, tool_choice, parallel: bool, response_format, chat: bool, target):
    """A generation's tools: ``(tools to render or None, parameters schemas or None, the
    response_format to generate with)``; a required or named choice becomes the calls' grammar
    (its markers as the target's tokenizer spells them).

    Raises:
        ToolError: bad tools or tool choice, tools without messages, tools with a response format.
    """
    if tools is None:
        if tool_choice is not None:
            raise ToolError("tool_choice needs tools.")
        return None, None, response_format
    if not chat:
        raise ToolError("tools need chat messages (the chat template renders them), not a text prompt.")
    if not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be True or False, got {parallel!r}.")
    schemas = check_tools(tools)
    mode, name = chosen_tool(tool_choice, schemas)
    if mode == "none":
        return None, None, response_format
    if response_format is not None and grammar_source(response_format) is not None:
        raise ToolError("give a response_format or tools, not both (or tool_choice 'none').")
    if mode == "auto":
        return list(tools), schemas, response_format
    return list(tools), schemas, call_grammar(schemas, name, parallel, call_markers(target.tokenizer))


def with_tool_calls(target, result: GenerationResult, schemas) -> GenerationResult:
    """``result`` with the tool calls its output holds (:func:`parse_tool_calls`), read from its
    tokens with special tokens kept (a template may mark ``<tool_call>`` special) and the final EOS
    left out."""
    if schemas is None:
        return result
    ids = result.token_ids[:-1] if result.stop_reason == "eos" else result.token_ids
    parsed = parse_tool_calls(target.decode(ids, special_tokens=True), schemas)
    return result if parsed is None else dataclasses.replace(result, tool_calls=parsed[1])


def grammar_compiler(target) -> GrammarCompiler:
    """The target's grammar compiler (its tokenizer as the grammar engine reads it), built on first
    use and kept on the target; building it takes seconds, so the server builds it at start.

    Raises:
        ConfigError: a tokenizer the grammar engine cannot read.
    """
    lock = target.__dict__.setdefault("_grammar_lock", threading.Lock())
    with lock:
        compiler = target.__dict__.get("_grammar_compiler")
        if compiler is None:
            compiler = GrammarCompiler(target.tokenizer, target.vocab_size,
                                       target.eos_token_ids | target.end_of_turn_ids)
            target.__dict__["_grammar_compiler"] = compiler
    return compiler


def compile_response_format(target, response_format: Mapping[str, Any] | None) -> Grammar | None:
    """A ``response_format`` compiled for ``target`` (``None`` for unconstrained text). The
    target's tokenizer is read for the grammar engine once and kept on the target, with the
    :data:`KEPT_GRAMMARS` formats compiled last.

    Raises:
        GrammarError: a bad format, schema, regex or grammar, in one sentence.
        ConfigError: a tokenizer the grammar engine cannot read.
    """
    if response_format is None:
        return None
    if grammar_source(response_format) is None:  # {"type": "text"}, after its shape is checked
        return None
    key = json.dumps(response_format, sort_keys=True, default=repr)
    compiler = grammar_compiler(target)
    lock = target.__dict__["_grammar_lock"]
    with lock:
        kept = target.__dict__.setdefault("_kept_grammars", OrderedDict())
        grammar = kept.pop(key, None)
    if grammar is None:
        grammar = compiler.compile(response_format)
    with lock:
        kept[key] = grammar
        while len(kept) > KEPT_GRAMMARS:
            kept.popitem(last=False)
    return grammar


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
    """A prompt as :func:`generate` reads it: text tokenized with the target's special prefix (BOS),
    or token ids checked.

    Returns:
        ``[P]`` long on the target's device, P >= 1.

    Args:
        prompt: text, a list or tuple of ``int``, or a 1-D integer tensor; nothing else.

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
