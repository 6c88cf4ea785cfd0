"""What a generation's output must be: the tools a chat may call and the response format it must
follow, checked and compiled once per request (:func:`check_output`), and the calls read back from
the output (:func:`with_tool_calls`).

A required or named ``tool_choice`` becomes a grammar over the calls, so both constraints reach the
loop the same way: one compiled :class:`~specwise.engine.grammar.Grammar` whose mask applies before
the sampling options (docs/algorithms.md §1.4).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from specwise.engine.grammar import Grammar, GrammarCompiler, grammar_source
from specwise.engine.types import GenerationResult
from specwise.targets.chat import check_template_takes_tools
from specwise.targets.tool_calls import (
    ToolError,
    call_grammar,
    call_markers,
    check_tools,
    chosen_tool,
    parse_tool_calls,
)


@dataclass(frozen=True)
class OutputRules:
    """A request's checked tools and output format.

    Attributes:
        tools: OpenAI's tool definitions for the chat template to render, or ``None``.
        schemas: the tools' parameters schemas by name, to parse calls from the output with, or
            ``None`` when no calls are read back.
        grammar: the compiled grammar the output follows (the ``response_format``, or the calls'
            grammar of a required or named ``tool_choice``), or ``None``.
    """

    tools: list[dict] | None = None
    schemas: dict[str, dict] | None = None
    grammar: Grammar | None = None


def check_output(target, *, tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                 parallel_tool_calls: bool = True, response_format: Mapping[str, Any] | None = None,
                 chat: bool = False) -> OutputRules:
    """Check a request's tools and compile the grammar its output takes, once.

    Args:
        target: the target the request runs on (its tokenizer spells the call markers).
        tools, tool_choice, parallel_tool_calls, response_format: as :func:`specwise.generate`
            takes them. chat: whether the request is a chat (tools need one).

    Returns:
        the :class:`OutputRules`.

    Raises:
        ToolError: bad tools or tool choice, tools without messages, tools with a response format.
        PromptError: tools for a chat template that does not write calls as ``<tool_call>`` blocks.
        GrammarError: a bad format, schema, regex or grammar, in one sentence.
        ConfigError: a tokenizer the grammar engine cannot read.
    """
    render, schemas, response_format = tool_setup(tools, tool_choice, parallel_tool_calls, response_format, chat,
                                                  target)
    if render:  # only tools to render need the template (a target may carry no tokenizer)
        check_template_takes_tools(target.tokenizer, target.name, render)
    return OutputRules(render, schemas, compile_response_format(target, response_format))


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
    use and kept by the target (``kept.once``); building it takes seconds, so the server builds it
    at start.

    Raises:
        ConfigError: a tokenizer the grammar engine cannot read.
    """
    return target.kept.once.get("grammar_compiler", lambda: GrammarCompiler(
        target.tokenizer, target.vocab_size, target.eos_token_ids | target.end_of_turn_ids))


def compile_response_format(target, response_format: Mapping[str, Any] | None) -> Grammar | None:
    """A ``response_format`` compiled for ``target`` (``None`` for unconstrained text). The
    target's tokenizer is read for the grammar engine once and kept by the target, with the
    :data:`specwise.engine.kept.KEPT_GRAMMARS` formats compiled last.

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
    # compiled outside the lock: two requests' schemas compile side by side
    return target.kept.grammars.get(key, lambda: compiler.compile(response_format), once=False)
