"""Tool calls: OpenAI's ``tools`` and ``tool_choice`` through a chat template that writes ``<tool_call>``
blocks, in the library and through ``specwise serve`` with the official ``openai`` client.

A required or named call is constrained (a grammar per tool, arguments by its parameters schema), so
on a tiny random float64 model every output is a valid call, equal under every method to ``ar``'s;
``auto`` output is parsed, and a malformed call comes back as text.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import specwise
from conftest import TEXT_PIECES, TOOL_CALL_TEMPLATE, make_text_target, make_text_tokenizer, save_chat_model
from serving import Server
from specwise.errors import ConfigError, PromptError
from specwise.serve.responses import CallWatch
from specwise.targets.tool_calls import (
    ToolError,
    call_grammar,
    call_markers,
    check_tools,
    chosen_tool,
    held_back,
    parse_tool_calls,
)

pytest.importorskip("llguidance")

TEMPLATE = TOOL_CALL_TEMPLATE
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "the time, no arguments"}},
]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object", "properties": {}, "additionalProperties": False}}
MESSAGES = [{"role": "user", "content": "the weather in Paris?"}]
METHODS = ("ar", "pld", "lookahead", "suffix")
#: the tiny vocabulary with a newline, which a <tool_call> block needs
PIECES = TEXT_PIECES + ("\n",)


def tool_target():
    target = make_text_target("llama", seed=3, pieces=PIECES)
    target.tokenizer.chat_template = TEMPLATE
    return target


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# --------------------------------------------------------------------------------------------
# checking and parsing


def test_tools_are_checked_and_a_function_without_parameters_takes_none():
    assert check_tools(TOOLS) == SCHEMAS


@pytest.mark.parametrize("tools, message", [
    ([], "non-empty list"),
    ("get_weather", "non-empty list"),
    ([{"type": "retrieval"}], "tool 0 must be"),
    ([{"type": "function", "function": {"name": "has space"}}], "letters, digits"),
    ([TOOLS[1], TOOLS[1]], "two tools are named 'now'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "schema of an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}],
     "not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "its 'type' is 'string'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}}}],
     "tool 'f' use what constrained output cannot enforce .*if"),
])
def test_bad_tools_are_one_sentence(tools, message):
    with pytest.raises(ToolError, match=message) as raised:
        check_tools(tools)
    assert "\n" not in str(raised.value)


def test_tool_choice_shapes():
    assert chosen_tool(None, SCHEMAS) == ("auto", None)
    assert chosen_tool("required", SCHEMAS) == ("required", None)
    assert chosen_tool({"type": "function", "function": {"name": "now"}}, SCHEMAS) == ("named", "now")
    for bad, message in [("sometimes", "one of none"), ({"type": "function"}, "a named tool_choice"),
                         (3, "a named tool_choice"),
                         ({"type": "function", "function": {"name": "fly"}}, "'fly', which is not among")]:
        with pytest.raises(ToolError, match=message):
            chosen_tool(bad, SCHEMAS)


def test_valid_calls_are_parsed_with_the_text_before_them():
    text = "Let me look. " + call_text("get_weather", {"city": "Paris", "unit": "c"}) + "\n" + call_text("now", {})
    content, calls = parse_tool_calls(text, SCHEMAS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"}),
                                                                    ("now", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls(call_text("now", {}), SCHEMAS)[0] is None


@pytest.mark.parametrize("text", [
    "no call here",
    "<tool_call>\n{\"name\": \"now\", \"arguments\": {}\n</tool_call>",  # not JSON
    call_text("fly", {}),  # an unknown tool
    call_text("get_weather", {"city": "Paris"}),  # a required argument missing
    call_text("get_weather", {"city": "Paris", "unit": "k"}),  # outside its enum
    call_text("now", {}) + " and then some text",  # text after the calls
    "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}",  # never closed
    '<tool_call>\n{"name": "now", "arguments": {}, "extra": 1}\n</tool_call>',
])
def test_a_malformed_call_is_never_passed_off_as_valid(text):
    assert parse_tool_calls(text, SCHEMAS) is None


def test_streamed_text_holds_back_what_may_open_a_call():
    assert held_back("hello <tool") == len("<tool") and held_back("hello <") == 1 and held_back("hello") == 0
    watch = CallWatch()
    pieces = ["Sure", ", <to", "ol_call>\n{", '"name": "now"}']
    assert [watch.feed(p) for p in pieces] == ["Sure", ", ", "", ""]
    assert watch.pending.startswith("<tool_call>")
    watch = CallWatch()
    assert [watch.feed(p) for p in ["a <to", "p> b"]] == ["a ", "<top> b"]


def test_history_with_calls_and_results_is_rendered_by_the_template():
    target = tool_target()
    history = MESSAGES + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = target.tokenizer.decode(target.encode_chat(history, TOOLS))
    assert text.startswith("<tools>get_weather;now;</tools><the weather in Paris?>")
    assert call_text("get_weather", {"city": "Paris", "unit": "c"}) in text and text.endswith("[sunny]:")
    with pytest.raises(PromptError, match="message 1 has a tool call"):
        target.encode_chat(history[:1] + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "not json"}}]}])


# --------------------------------------------------------------------------------------------
# the library


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_is_valid_and_every_method_gives_ars_tokens(method, choice):
    target = tool_target()
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_new_tokens=120, parallel_tool_calls=False)
    result = specwise.generate(target, method=method, **kwargs)
    assert result.token_ids == specwise.generate(target, method="ar", **kwargs).token_ids
    assert result.finish_reason == "tool_calls" and result.tool_calls
    for call in result.tool_calls:
        assert call.name in SCHEMAS and (isinstance(choice, str) or call.name == "get_weather")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


#: a parameters schema whose $ref points into itself, and one that leaves its type out
MOVE = {"type": "function", "function": {"name": "move", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/properties/start"}, "start": {"type": "string", "maxLength": 4}},
    "required": ["to", "start"], "additionalProperties": False}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "properties": {"text": {"type": "string", "maxLength": 4}}, "required": ["text"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool", [MOVE, ECHO], ids=["ref", "untyped"])
def test_parameters_with_a_local_ref_or_no_type_give_a_valid_call(tool):
    target = tool_target()
    schemas = check_tools([tool])
    name = tool["function"]["name"]
    assert schemas[name]["type"] == "object"
    for seed in range(3):
        result = specwise.generate(target, messages=MESSAGES, tools=[tool], tool_choice="required", max_new_tokens=120,
                                   parallel_tool_calls=False, temperature=1.0, seed=seed)
        assert result.finish_reason == "tool_calls" and result.tool_calls[0].name == name
        arguments = json.loads(result.tool_calls[0].arguments)
        assert isinstance(arguments, dict)
        jsonschema.validate(arguments, schemas[name])


@pytest.mark.parametrize("method", METHODS)
def test_parallel_calls_cut_by_the_length_limit_are_text_and_equal_to_ars(method):
    target = tool_target()  # the random model goes on calling, so 80 tokens end inside a second call
    kwargs = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_new_tokens=80)
    result = specwise.generate(target, method=method, **kwargs)
    assert result.token_ids == specwise.generate(target, method="ar", **kwargs).token_ids
    assert result.finish_reason == "length" and result.tool_calls is None
    assert result.text.startswith("<tool_call>\n") and result.text.count("<tool_call>") >= 2


def test_sampled_required_calls_always_validate_and_one_call_when_not_parallel():
    target = tool_target()
    for seed in range(12):
        result = specwise.generate(target, messages=MESSAGES, tools=TOOLS, tool_choice="required", method="pld",
                                   max_new_tokens=80, temperature=1.0, seed=seed, parallel_tool_calls=False)
        assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1
        call = result.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_markers_a_vocabulary_has_as_one_token_are_named_by_id():
    tokenizer = make_text_tokenizer(PIECES)
    assert call_markers(tokenizer) == ('"<tool_call>"', '"</tool_call>"')
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen2.5's vocabulary has them
    opening, closing = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert call_markers(tokenizer) == (f"<[{opening}]>", f"<[{closing}]>")


def test_the_calls_grammar_writes_calls_as_the_template_does():
    grammar = call_grammar(SCHEMAS, "now", parallel=False)["grammar"]
    assert grammar.startswith('start: call "\\n"?\ncall: "<tool_call>" "\\n" (call_0) "\\n" "</tool_call>"')
    target = tool_target()
    result = specwise.generate(target, messages=MESSAGES, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "now"}}, max_new_tokens=80, parallel_tool_calls=False)
    assert result.text.rstrip("\n") == call_text("now", {}) and result.stop_reason in ("grammar", "eos")


def test_auto_and_none():
    target = tool_target()
    auto = specwise.generate(target, messages=MESSAGES, tools=TOOLS, max_new_tokens=12)
    plain = specwise.generate(target, messages=MESSAGES, max_new_tokens=12)
    assert auto.tool_calls is None and auto.finish_reason in ("length", "eos", "stop")
    none = specwise.generate(target, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_new_tokens=12)
    assert none.token_ids == plain.token_ids  # "none" renders no tools
    assert target.encode_chat(MESSAGES, TOOLS).numel() > target.encode_chat(MESSAGES).numel()


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(messages=MESSAGES, tool_choice="auto"), ToolError, "tool_choice needs tools"),
    (dict(prompt="hi", tools=TOOLS), ToolError, "need chat messages"),
    (dict(messages=MESSAGES, tools=TOOLS, response_format={"type": "json_object"}), ToolError, "not both"),
    (dict(messages=MESSAGES, tools=TOOLS, parallel_tool_calls="yes"), ToolError, "True or False"),
])
def test_bad_tool_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        specwise.generate(tool_target(), max_new_tokens=4, **kwargs)
    assert issubclass(error, ConfigError)


def test_tools_on_a_template_that_cannot_render_them_are_refused():
    target = make_text_target("llama", seed=3, pieces=PIECES)
    target.tokenizer.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}:"
    with pytest.raises(PromptError, match="does not write tool calls as <tool_call> blocks"):
        specwise.generate(target, messages=MESSAGES, tools=TOOLS, max_new_tokens=4)


def _counting(monkeypatch, target) -> dict[str, int]:
    """Counts of the chat template's renders and the grammar engine's compiles from now on."""
    from specwise.engine.grammar import GrammarCompiler

    counts = {"renders": 0, "compiles": 0}
    render, compile_ = target.tokenizer.apply_chat_template, GrammarCompiler.compile

    def counted_render(*args, **kwargs):
        counts["renders"] += 1
        return render(*args, **kwargs)

    def counted_compile(self, *args, **kwargs):
        counts["compiles"] += 1
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(target.tokenizer, "apply_chat_template", counted_render)
    monkeypatch.setattr(GrammarCompiler, "compile", counted_compile)
    return counts


@pytest.mark.parametrize("path", ["generate", "server"])
def test_a_request_renders_its_template_once_and_compiles_its_grammar_once(monkeypatch, path):
    from specwise.request import run_request
    from specwise.serve.protocol import ChatRequest
    from specwise.serve.requests import Limits, prepare

    target = tool_target()
    assert target.end_of_turn_ids is not None  # read from the template once per target, before counting
    counts = _counting(monkeypatch, target)
    if path == "generate":
        result = specwise.generate(target, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_new_tokens=120,
                                   parallel_tool_calls=False)
    else:
        limits = Limits("tiny", "ar", ("ar",), max_tokens_cap=120, max_prompt_tokens=None, max_messages=4)
        body = ChatRequest(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
                           parallel_tool_calls=False)
        result = run_request(target, prepare(target, body, True, limits).request)
    assert counts == {"renders": 1, "compiles": 1}
    assert result.tool_calls
    specwise.generate(target, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_new_tokens=4,
                      parallel_tool_calls=False)
    assert counts == {"renders": 2, "compiles": 1}  # the same calls' grammar is kept by the target


# --------------------------------------------------------------------------------------------
# the server, through the openai client

openai = pytest.importorskip("openai")
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_chat_model(tmp_path_factory.mktemp("served-tools") / "tiny-tools", TEMPLATE, PIECES, seed=3)


@pytest.fixture(scope="module")
def client(model_dir):
    server = Server(model_dir, "--method", "ar", "--methods", ",".join(METHODS), "--api-key", KEY)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    server.stop()


@pytest.fixture(scope="module")
def served(model_dir):
    return specwise.load_target(model_dir, dtype="float64")


@pytest.mark.parametrize("method", ["ar", "pld"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_served_required_calls_streamed_or_not(client, served, choice, method):
    local = specwise.generate(served, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_new_tokens=120,
                              parallel_tool_calls=False)
    extra = {"speculative": {"method": method}}
    response = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              max_completion_tokens=120, temperature=0, extra_body=extra,
                                              parallel_tool_calls=False)
    choice_ = response.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice_.message.tool_calls]
    assert calls == [(c.name, json.loads(c.arguments)) for c in local.tool_calls]
    assert all(c.type == "function" and c.id.startswith("call_") for c in choice_.message.tool_calls)
    chunks = list(client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, stream=True,
                                                 tool_choice=choice, max_completion_tokens=120, temperature=0,
                                                 extra_body=extra, parallel_tool_calls=False))
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    streamed = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in streamed] == [
        (i, name, arguments) for i, (name, arguments) in enumerate(calls)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_served_auto_and_none_answer_in_text(client, served):
    for choice in ("auto", "none"):
        local = specwise.generate(served, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_new_tokens=16,
                                  include_stop=False)
        response = client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS,
                                                  tool_choice=choice, max_completion_tokens=16, temperature=0)
        text = served.decode(local.token_ids, special_tokens=True)  # as the server streams it
        assert response.choices[0].message.content == text
        assert response.choices[0].message.tool_calls is None
        chunks = list(client.chat.completions.create(model="tiny-tools", messages=MESSAGES, tools=TOOLS, stream=True,
                                                     tool_choice=choice, max_completion_tokens=16, temperature=0))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_served_history_with_a_tool_result(client, served):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    local = specwise.generate(served, messages=history, tools=TOOLS, max_new_tokens=8, include_stop=False)
    response = client.chat.completions.create(model="tiny-tools", messages=history, tools=TOOLS,
                                              max_completion_tokens=8, temperature=0)
    assert response.choices[0].message.content == served.decode(local.token_ids, special_tokens=True)
    assert response.usage.prompt_tokens == served.encode_chat(history, TOOLS).numel()


@pytest.mark.parametrize("kwargs, param, message", [
    (dict(tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice", "not among the tools"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tools", "not both"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 1}}}]),
     "tools", "not a valid JSON schema"),
    (dict(tools=None, tool_choice="auto"), "tool_choice", "tool_choice needs tools"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(client, kwargs, param, message):
    args = {"tools": TOOLS, **kwargs}
    if args["tools"] is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny-tools", messages=MESSAGES, max_completion_tokens=8, **args)
    error = raised.value.body
    assert error["param"] == param and message in error["message"] and "\n" not in error["message"]
