"""``specwise bench --conversations``: multi-turn workloads turn by turn, every contender reading the
same tokens, on a tiny float64 chat target (greedy: every method's reply equals ``ar``'s)."""

from __future__ import annotations

import json

import pytest

from conftest import TEXT_PIECES, TOOL_CALL_TEMPLATE, make_text_target, save_chat_model
from specwise.cli import main
from specwise.errors import ConfigError
from specwise.lab.bench.contenders import specwise_contender
from specwise.lab.bench.conversations import (
    call_schema,
    is_valid,
    load_conversations,
    run_conversations,
    summarize_turns,
    turns_markdown,
)

pytest.importorskip("llguidance")

TEMPLATE = TOOL_CALL_TEMPLATE
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"],
    "additionalProperties": False}}}]
ANSWER = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"],
    "additionalProperties": False}}}
CONVERSATIONS = [
    {"id": "c1", "kind": "tools", "system": "be brief", "tools": TOOLS, "turns": [
        {"user": "find the cat", "tool_choice": "required", "turn": "tool call"},
        {"tool_result": "the cat sat on the mat", "turn": "prose"}]},
    {"id": "c2", "kind": "json", "turns": [
        {"user": "the answer is at the start", "response_format": ANSWER, "turn": "JSON"},
        {"user": "and again", "response_format": ANSWER, "turn": "JSON"}]},
]


def chat_target():
    target = make_text_target("llama", seed=3, pieces=TEXT_PIECES + ("\n",))
    target.tokenizer.chat_template = TEMPLATE
    return target


def write(path, conversations) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return str(path)


def test_every_contender_reads_the_same_turns_and_greedy_replies_equal_the_reference(tmp_path):
    target = chat_target()
    conversations = load_conversations(write(tmp_path / "c.jsonl", CONVERSATIONS))
    contenders = [specwise_contender(target, "ar"), specwise_contender(target, "pld", draft_budget="fixed"),
                  specwise_contender(target, "suffix", draft_budget="fixed")]
    seen = []
    rows = run_conversations(target, contenders, conversations, max_new_tokens=40, temperature=0.0, seed=0,
                             on_turn=seen.append)
    assert rows == seen and len(rows) == 3 * 4
    assert [(r["conversation"], r["turn"], r["contender"]) for r in rows[:3]] == [("c1", 0, c.name) for c in contenders]
    call, answer = rows[0], rows[6]
    assert call["turn_kind"] == "tool call" and call["valid"]  # constrained: a call of a tool, parsed
    assert answer["turn_kind"] == "JSON" and answer["valid"]
    assert all(r["same_as_reference"] for r in rows)  # greedy, float64: every method's reply is ar's
    summary = summarize_turns(rows)
    overall = {r["contender"]: r for r in summary if r["turn_kind"] == "all"}
    assert overall["ar"]["turns"] == 4 and overall["ar"]["speedup"] == pytest.approx(1.0)
    assert {r["turn_kind"] for r in summary} == {"all", "tool call", "prose", "JSON"}
    assert "| tool call | pld | 1 | 1 |" in turns_markdown(summary, "# run")


def test_a_call_turn_and_its_reply_make_the_next_turns_history(tmp_path):
    target = chat_target()
    conversations = load_conversations(write(tmp_path / "c.jsonl", CONVERSATIONS[:1]))
    prompts = []
    ar = specwise_contender(target, "ar")

    def recording(prompt_ids, *args, **kwargs):
        prompts.append(target.decode(prompt_ids, special_tokens=True))
        return ar.run(prompt_ids, *args, **kwargs)

    run_conversations(target, [type(ar)("ar", recording)], conversations, max_new_tokens=40, temperature=0.0, seed=0)
    first, second = prompts
    assert first == "<tools>lookup;</tools><be brief><find the cat>:<tool_call>\n"  # the call's opening, then
    # the constrained call; the next turn holds it as the template renders a call, then the tool's result
    assert second.startswith("<tools>lookup;</tools><be brief><find the cat><<tool_call>\n")
    assert second.endswith("</tool_call>>[the cat sat on the mat]:")
    assert '<<tool_call>\n{"name": "lookup", "arguments": ' in second  # the call, as the template renders it


def test_validity_of_a_reply(tmp_path):
    turn = load_conversations(write(tmp_path / "c.jsonl", CONVERSATIONS))[0].turns[0]
    assert is_valid('{"name": "lookup", "arguments": {"q": "x"}}', turn, tuple(TOOLS))
    assert not is_valid('{"name": "other", "arguments": {}}', turn, tuple(TOOLS))
    assert not is_valid("lookup(q=x)", turn, tuple(TOOLS))
    assert call_schema(tuple(TOOLS))["anyOf"][0]["properties"]["name"] == {"const": "lookup"}


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"id": "x"}', "non-empty list of turns"),
    ('{"turns": [{"user": "a", "tool_result": "b", "turn": "prose"}]}', "either a user message or a tool_result"),
    ('{"turns": [{"user": "a", "turn": "poem"}]}', "is one of tool call, JSON, prose, code"),
    ('{"turns": [{"user": "a", "turn": "tool call", "tool_choice": "required"}]}', "has no tools"),
    ('{"tools": ["f"], "turns": [{"user": "a", "turn": "prose"}]}', "OpenAI function tools"),
])
def test_a_bad_conversations_file_is_one_sentence(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_conversations(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_conversations(tmp_path / "missing.jsonl")


def test_the_cli_refuses_a_bad_file_before_loading_a_model(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n")
    assert main(["bench", "--conversations", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "holds no conversation" in capsys.readouterr().err


def test_the_cli_runs_a_conversations_file_and_writes_its_turns_as_they_come(tmp_path, capsys):
    model = save_chat_model(tmp_path / "tiny-chat", TEMPLATE, TEXT_PIECES + ("\n",), seed=3)
    out = tmp_path / "out"
    assert main(["bench", "--target", str(model), "--dtype", "float64", "--conversations",
                 write(tmp_path / "c.jsonl", CONVERSATIONS), "--methods", "ar,pld[draft_budget=fixed]",
                 "--max-new-tokens", "40", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "turns.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 and all(r["valid"] and r["same_as_reference"] for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert {r["contender"] for r in summary["rows"]} == {"ar", "pld[draft_budget=fixed]"}
    assert "| all | ar | 4 | 4 |" in (out / "report.md").read_text()
