"""``specwise bench --conversations FILE``: multi-turn agentic workloads, turn by turn, every
contender reading the same tokens.

A conversations file (JSON Lines, one conversation per line; ``benchmarks/agentic.py --export FILE``
builds one from the project's prompt data) holds, per conversation: ``id``, ``kind``, an optional
``system`` message and ``tools`` (OpenAI's function format), and ``turns``, each either a ``user``
message or a ``tool_result`` (the answer to the call the previous turn made), with ``turn`` (what the
reply is: ``tool call``, ``JSON``, ``prose``, ``code``), and optionally ``tool_choice: "required"``
(the reply must be a call) or a ``response_format`` (a JSON schema).

Each turn's prompt is the conversation so far, rendered by the target's chat template with its
tools, as token ids: the same ids for every contender. A call turn is that prompt followed by the
template's call opening (``<tool_call>`` and a newline) and constrained by the JSON schema of one
call of any tool; a JSON turn by its schema. The history every contender's next turn reads is the
first contender's reply (run first on every turn), so all read the same tokens turn after turn.

Our contenders each run on a target object of their own with prefix reuse on (a conversation's
earlier turns stay cached, as in a server) and their drafter kept across turns and conversations
(``suffix`` and ``auto`` index earlier replies); llama-server peers run with ``cache_prompt`` on.
Measured per turn: wall time (prefill included), new tokens, whether the reply is valid (a call
that parses and names a tool, JSON that parses, a non-empty reply), τ for ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from specwise.errors import ConfigError

CALL_OPENING = "<tool_call>\n"
TURN_KINDS = ("tool call", "JSON", "prose", "code")


@dataclass(frozen=True)
class Turn:
    """One turn: a user message or a tool's result, and what the reply must be."""

    kind: str
    user: str | None = None
    tool_result: str | None = None
    tool_choice: str | None = None
    response_format: dict | None = None


@dataclass(frozen=True)
class Conversation:
    """One conversation of a workload file."""

    id: str
    kind: str
    turns: tuple[Turn, ...]
    system: str | None = None
    tools: tuple[dict, ...] = ()


def load_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSON Lines file.

    Raises:
        ConfigError: an unreadable file, a line that is not JSON, or a conversation that misses a
            field or gives one of the wrong type (the line and field named).
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--conversations {path} cannot be read: {exc}.") from None
    conversations = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            conversations.append(_conversation(json.loads(line), number))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--conversations {path}, line {number}: not JSON ({exc.msg}).") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--conversations {path}, line {number}: {exc}") from None
    if not conversations:
        raise ConfigError(f"--conversations {path} holds no conversation.")
    return conversations


def _conversation(data: Any, number: int) -> Conversation:
    if not isinstance(data, dict) or not isinstance(data.get("turns"), list) or not data["turns"]:
        raise ValueError("a conversation is an object with a non-empty list of turns.")
    tools = data.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and "function" in t for t in tools):
        raise ValueError("tools must be a list of OpenAI function tools ({\"type\": \"function\", \"function\": ...}).")
    turns = []
    for turn in data["turns"]:
        if not isinstance(turn, dict) or (("user" in turn) == ("tool_result" in turn)):
            raise ValueError("each turn has either a user message or a tool_result.")
        if turn.get("turn") not in TURN_KINDS:
            raise ValueError(f"a turn's \"turn\" is one of {', '.join(TURN_KINDS)}, not {turn.get('turn')!r}.")
        if turn.get("tool_choice") == "required" and not tools:
            raise ValueError("a turn requires a tool call but the conversation has no tools.")
        turns.append(Turn(turn["turn"], turn.get("user"), turn.get("tool_result"), turn.get("tool_choice"),
                          turn.get("response_format")))
    return Conversation(str(data.get("id", f"line-{number}")), str(data.get("kind", "")), tuple(turns),
                        data.get("system"), tuple(tools))


def call_schema(tools: tuple[dict, ...]) -> dict:
    """The JSON schema of one call of any of ``tools`` (what follows the call's opening)."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "arguments": t["function"].get("parameters", {"type": "object"})},
                       "required": ["name", "arguments"]} for t in tools]}


@dataclass
class _History:
    """A conversation's messages so far, and the id of the call the last reply made."""

    messages: list[dict] = field(default_factory=list)
    last_call: str | None = None


def turn_prompt(target, conversation: Conversation, history: _History, turn: Turn) -> tuple[list[int], dict | None]:
    """``(prompt ids, response_format)`` of ``turn``: the messages so far with the turn's own, rendered
    with the conversation's tools; a call turn adds the call's opening and constrains to one call."""
    if turn.tool_result is not None:
        history.messages.append({"role": "tool", "content": turn.tool_result, "tool_call_id": history.last_call or "call_0"})
    else:
        history.messages.append({"role": "user", "content": turn.user})
    ids = target.encode_chat(history.messages, tools=list(conversation.tools) or None).tolist()
    if turn.tool_choice == "required":
        ids += target.tokenizer(CALL_OPENING, add_special_tokens=False).input_ids
        return ids, {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema(conversation.tools)}}
    return ids, turn.response_format


def reply_message(text: str, turn: Turn, index: int) -> dict:
    """The assistant message a reply's text makes in the history (a call turn's JSON as a tool call)."""
    if turn.tool_choice == "required":
        call = json.loads(text)
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{index}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]}
    return {"role": "assistant", "content": text}


def is_valid(text: str, turn: Turn, tools: tuple[dict, ...]) -> bool:
    """A call that parses and names a tool; JSON that parses; else a non-empty reply."""
    if turn.tool_choice == "required" or turn.response_format is not None:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if turn.tool_choice != "required":
            return True
        names = {t["function"]["name"] for t in tools}
        return isinstance(value, dict) and value.get("name") in names and isinstance(value.get("arguments"), dict)
    return bool(text.strip())


def run_conversations(target, contenders: list, conversations: list[Conversation], *, max_new_tokens: int,
                      temperature: float, seed: int, on_turn: Callable[[dict], None] | None = None) -> list[dict]:
    """Every contender through every conversation, turn by turn, the first contender's reply the
    history of every contender's next turn.

    Args:
        target: renders the prompts and decodes the replies (the first contender's tokenizer).
        contenders: :class:`specwise.lab.bench.contenders.Contender`; the first is the reference.
        on_turn: called with each row as it is measured (to write results as they come).

    Returns:
        one row per contender and turn: ``conversation``, ``kind``, ``turn``, ``turn_kind``,
        ``contender``, ``wall_s``, ``new_tokens``, ``valid``, ``tau``, ``same_as_reference``.
    """
    rows = []
    for conversation in conversations:
        history = _History([{"role": "system", "content": conversation.system}] if conversation.system else [])
        for index, turn in enumerate(conversation.turns):
            prompt, response_format = turn_prompt(target, conversation, history, turn)
            reference_text = None
            for contender in contenders:
                kept = {"cache_prompt": True} if contender.caches_prompts else {}
                outcome = contender.run(torch.tensor(prompt, dtype=torch.long), max_new_tokens,
                                        temperature=temperature, seed=seed + index, response_format=response_format,
                                        **kept)
                text = target.decode(outcome.token_ids)
                reference_text = text if reference_text is None else reference_text
                stats = outcome.stats
                row = {"conversation": conversation.id, "kind": conversation.kind, "turn": index,
                       "turn_kind": turn.kind, "contender": contender.name, "wall_s": outcome.wall_time_s,
                       "new_tokens": len(outcome.token_ids), "valid": is_valid(text, turn, conversation.tools),
                       "tau": None if stats is None else stats.mean_accepted_length,
                       "same_as_reference": text == reference_text}
                rows.append(row)
                if on_turn is not None:
                    on_turn(row)
            if not is_valid(reference_text, turn, conversation.tools):
                break  # the reference's reply cannot be the next turn's history
            message = reply_message(reference_text, turn, index)
            history.messages.append(message)
            history.last_call = message["tool_calls"][0]["id"] if "tool_calls" in message else None
    return rows


def summarize_turns(rows: list[dict]) -> list[dict]:
    """Per contender and turn kind (and ``all``): turns, valid turns, seconds per valid turn, tok/s
    and the ratio of seconds per turn to the first contender's on the same turns."""
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    reference = contenders[0] if contenders else None
    kinds = ["all"] + list(dict.fromkeys(r["turn_kind"] for r in rows))
    out = []
    for kind in kinds:
        for name in contenders:
            mine = [r for r in rows if r["contender"] == name and kind in ("all", r["turn_kind"])]
            ref = [r for r in rows if r["contender"] == reference and kind in ("all", r["turn_kind"])]
            valid = [r for r in mine if r["valid"]]
            seconds, ref_seconds = sum(r["wall_s"] for r in mine), sum(r["wall_s"] for r in ref)
            taus = [r["tau"] for r in mine if r["tau"]]
            out.append({"turn_kind": kind, "contender": name, "turns": len(mine), "valid": len(valid),
                        "seconds_per_valid_turn": seconds / len(valid) if valid else None,
                        "tokens_per_second": sum(r["new_tokens"] for r in mine) / seconds if seconds else 0.0,
                        "speedup": ref_seconds / seconds if seconds else None,
                        "mean_tau": sum(taus) / len(taus) if taus else None,
                        "same_as_reference": sum(bool(r["same_as_reference"]) for r in mine)})
    return out


def turns_markdown(summary: list[dict], header: str) -> str:
    """The summary as a markdown table under ``header``."""
    fmt = lambda x, spec: "–" if x is None else format(x, spec)  # noqa: E731
    lines = [header, "", "| turns | contender | turns run | valid | s per valid turn | tok/s | × first (time) | "
             "mean τ | same reply as first |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary:
        lines.append(f"| {row['turn_kind']} | {row['contender']} | {row['turns']} | {row['valid']} | "
                     f"{fmt(row['seconds_per_valid_turn'], '.2f')} | {row['tokens_per_second']:.1f} | "
                     f"{fmt(row['speedup'], '.2f')} | {fmt(row['mean_tau'], '.2f')} | {row['same_as_reference']} |")
    return "\n".join(lines) + "\n"
