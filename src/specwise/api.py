"""The public entry point: :func:`generate`, the friendly front door with keywords.

It builds one checked :class:`~specwise.request.GenerationRequest` (:func:`specwise.request.build_request`)
and runs it (:func:`specwise.request.run_request`); drafters are built by
:mod:`specwise.drafters.building` and output rules by :mod:`specwise.output`, whose public names
are re-exported here.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from specwise.drafters.building import build_drafter, engine_for, load_drafter, shared_drafter, spec_and_config
from specwise.engine.load import LoadShare
from specwise.engine.types import GenerationResult
from specwise.output import compile_response_format, grammar_compiler
from specwise.request import build_request, run_request

__all__ = ["build_drafter", "compile_response_format", "engine_for", "generate", "grammar_compiler",
           "load_drafter", "shared_drafter", "spec_and_config"]


def generate(
    target,
    prompt: str | list[int] | tuple[int, ...] | torch.Tensor | None = None,
    *,
    streamer: Callable[[list[int]], None] | None = None,
    text_streamer: Callable[[str], None] | None = None,
    load: LoadShare | None = None,
    **keywords: Any,
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
            (:class:`specwise.drafters.prediction.PredictionDrafter`); the output stays exactly the
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
    request = build_request(target, prompt, **keywords)
    return run_request(target, request, streamer=streamer, text_streamer=text_streamer, load=load)


def _front_door_signature() -> inspect.Signature:
    """:func:`generate`'s full signature for ``help()`` and editors: :func:`build_request`'s
    keywords (one list, kept there) with the run's own (``streamer``, ``text_streamer``, ``load``)."""
    own = inspect.signature(generate).parameters
    built = inspect.signature(build_request).parameters
    run = [own[name] for name in ("streamer", "text_streamer", "load")]
    params = [p for p in built.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature(params + run + [built["method_options"]], return_annotation=GenerationResult)


generate.__signature__ = _front_door_signature()
