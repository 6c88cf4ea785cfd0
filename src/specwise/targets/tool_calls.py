"""Tool calls in OpenAI's shape through a chat template that writes them as ``<tool_call>`` blocks.

Qwen2.5's template (and every Hermes-style one) renders the tools it is given in the system turn and
teaches the model to answer with one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This module checks OpenAI's ``tools`` and ``tool_choice``, builds the grammar that makes a required
or named call exact (a Lark grammar whose every call is a JSON object validated by that tool's
parameters schema, on llguidance's ``%json``), and reads the calls back out of generated text,
refusing any that does not name a known tool with arguments its schema accepts: a malformed call is
returned as text, never passed off as a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jsonschema

from specwise.engine.grammar import unsupported_in_schema
from specwise.errors import ConfigError

#: the block a Hermes-style template (Qwen2.5's) wraps each call in
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: the ``tool_choice`` strings (a named function is ``{"type": "function", "function": {"name": ...}}``)
TOOL_CHOICES = ("none", "auto", "required")
#: a function name as OpenAI allows it
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: JSON as the template itself writes a call's arguments (Python's json.dumps: a space after , and :)
_CALL_JSON = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)


class ToolError(ConfigError):
    """Tools, a tool choice or a tool-call message that cannot be served."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call.

    Attributes:
        id: ``call_`` and 24 hex digits, unique per call.
        name: the function's name (one of the request's tools).
        arguments: the arguments as a JSON string (an object its parameters schema accepts).
    """

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}`` (with ``index``
        for a streamed delta)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools and writes calls as ``<tool_call>`` blocks."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template and CALL_OPEN in template


def check_tools(tools: Any) -> dict[str, dict]:
    """Validate OpenAI's ``tools``.

    Args:
        tools: a non-empty list of ``{"type": "function", "function": {"name", "description"?,
            "parameters"?}}``; a function without ``parameters`` takes no arguments.

    Returns:
        each function's parameters schema by name, in the order given.

    Raises:
        ToolError: not such a list, a name OpenAI would refuse, a name given twice, or parameters
            that are not a valid JSON schema of an object.
    """
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise ToolError("tools must be a non-empty list of {'type': 'function', 'function': {...}} objects.")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(function, Mapping):
            raise ToolError(f"tool {i} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}.")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tool {i}'s name must be 1 to 64 letters, digits, '_' or '-', got {name!r}.")
        if name in schemas:
            raise ToolError(f"two tools are named {name!r}; give each function its own name.")
        parameters = function.get("parameters")
        schema = {"type": "object", "properties": {}, "additionalProperties": False} if parameters is None \
            else parameters
        if not isinstance(schema, Mapping) or schema.get("type", "object") != "object":
            raise ToolError(f"the parameters of tool {name!r} must be a JSON schema of an object "
                            f"(its 'type' is {schema.get('type') if isinstance(schema, Mapping) else schema!r}).")
        # arguments are always an object (OpenAI's rule); a schema that leaves its type out (or {})
        # means one, and without the type the grammar would allow any JSON value
        schema = {**schema, "type": "object"}
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ToolError(f"the parameters of tool {name!r} are not a valid JSON schema: {exc.message}.") from None
        refused = unsupported_in_schema(schema)
        if refused:
            raise ToolError(f"the parameters of tool {name!r} use what constrained output cannot enforce "
                            f"({refused}); leave it out of the schema.")
        schemas[name] = dict(schema)
    return schemas


def chosen_tool(tool_choice: Any, schemas: Mapping[str, dict]) -> tuple[str, str | None]:
    """The ``tool_choice`` as ``(mode, name)``: mode ``"none"``, ``"auto"`` (also for ``None``),
    ``"required"``, or ``"named"`` with the function's name.

    Raises:
        ToolError: another shape, or a function the tools do not name.
    """
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                            f"got {tool_choice!r}.")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(function, Mapping) \
            or not isinstance(function.get("name"), str):
        raise ToolError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}.")
    name = function["name"]
    if name not in schemas:
        raise ToolError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(schemas)}).")
    return "named", name


def call_markers(tokenizer) -> tuple[str, str]:
    """How a grammar names the ``<tool_call>`` and ``</tool_call>`` markers for ``tokenizer``: the
    one token a vocabulary gives each (Qwen2.5's added tokens, as ``<[id]>``; the grammar engine
    reads added tokens as special, never as their letters), else the text itself."""
    def term(marker: str) -> str:
        ids = tokenizer(marker, add_special_tokens=False).input_ids
        if len(ids) == 1 and ids[0] != tokenizer.unk_token_id and tokenizer.convert_ids_to_tokens(ids[0]) == marker:
            return f"<[{ids[0]}]>"
        return json.dumps(marker)
    return term(CALL_OPEN), term(CALL_CLOSE)


def call_grammar(schemas: Mapping[str, dict], only: str | None = None, parallel: bool = True,
                 markers: tuple[str, str] = (json.dumps(CALL_OPEN), json.dumps(CALL_CLOSE))) -> dict:
    """The ``response_format`` that makes the output tool calls and nothing else.

    Args:
        schemas: parameters schema by function name (:func:`check_tools`).
        only: the one function allowed (a named ``tool_choice``); ``None``: any of them.
        parallel: whether several calls may follow each other (``parallel_tool_calls``).
        markers: the grammar's terms for the opening and closing markers (:func:`call_markers`).

    Returns:
        ``{"type": "grammar", "grammar": ...}``: llguidance Lark, one ``%json`` alternative per
        function (its name a constant, its arguments its parameters schema), written the way the
        template writes calls.
    """
    names = [only] if only is not None else list(schemas)
    alternatives = []
    for i, name in enumerate(names):
        parameters = _refs_moved(dict(schemas[name]), "#/properties/arguments")
        lifted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
        body = {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False, **lifted,
                "x-guidance": _CALL_JSON}
        alternatives.append(f"call_{i}: %json {json.dumps(body)}")
    repeat = ' ("\\n" call)*' if parallel else ""
    opening, closing = markers
    # a closing newline is allowed: Qwen2.5 ends its calls with one before the end of its turn, and a
    # grammar without it would force one more call after that newline
    lines = [f'start: call{repeat} "\\n"?', f'call: {opening} "\\n" (' + " | ".join(f"call_{i}" for i in range(len(names)))
             + f') "\\n" {closing}', *alternatives]
    return {"type": "grammar", "grammar": "\n".join(lines)}


def _refs_moved(schema: Any, at: str) -> Any:
    """``schema`` (a parameters schema, its own document) as it reads when placed at JSON pointer
    ``at`` inside the call object: each local ``$ref`` into it points there, except those into
    ``$defs``/``definitions``, which the call object lifts to its own top level."""
    if isinstance(schema, list):
        return [_refs_moved(item, at) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")) \
                and not value.startswith(("#/$defs/", "#/definitions/")):
            moved[key] = at + value[1:]
        else:
            moved[key] = _refs_moved(value, at)
    return moved


def parse_tool_calls(text: str, schemas: Mapping[str, dict]) -> tuple[str | None, list[ToolCall]] | None:
    """The calls in generated ``text``, or ``None`` when it holds none that are valid.

    Every ``<tool_call>`` block must be JSON ``{"name": ..., "arguments": {...}}`` naming one of
    ``schemas`` with arguments its schema accepts, and nothing but blank space may follow the last
    block; otherwise the whole text is an answer (``None``).

    Returns:
        ``(content, calls)``: the text before the first block (``None`` when blank) and the calls.
    """
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    calls, end = [], start
    for match in _BLOCK.finditer(text, start):
        if text[end:match.start()].strip():
            return None
        call = _read_call(match.group(1), schemas)
        if call is None:
            return None
        calls.append(call)
        end = match.end()
    if not calls or text[end:].strip():
        return None
    content = text[:start].strip()
    return content or None, calls


def _read_call(block: str, schemas: Mapping[str, dict]) -> ToolCall | None:
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or set(data) != {"name", "arguments"} or data["name"] not in schemas:
        return None
    arguments = _arguments_object(data["arguments"])  # some models write the arguments as a JSON string
    if arguments is None:
        return None
    schema = schemas[data["name"]]
    if not jsonschema.validators.validator_for(schema)(schema).is_valid(arguments):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", data["name"], json.dumps(arguments, ensure_ascii=False))


def _arguments_object(arguments: Any) -> dict | None:
    """A call's arguments as an object: given as one, or as a JSON string of one; else ``None``."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def template_tool_calls(calls: Any, index: int) -> list[dict]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates read them: each call's
    ``function`` with its ``arguments`` as an object (OpenAI sends a JSON string).

    Raises:
        ToolError: not a list of ``{"type": "function", "function": {"name", "arguments"}}`` whose
            arguments are a JSON object.
    """
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ToolError(f"message {index}'s tool_calls must be a list of calls.")
    rendered = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = _arguments_object(function.get("arguments", "{}")) if isinstance(function, Mapping) else None
        if not isinstance(name, str) or arguments is None:
            raise ToolError(f"message {index} has a tool call that is not {{'function': {{'name': ..., "
                            f"'arguments': a JSON object}}}}.")
        rendered.append({"id": call.get("id"), "type": "function",
                         "function": {"name": name, "arguments": arguments}})
    return rendered


def held_back(text: str) -> int:
    """How many characters at the end of streamed ``text`` might open a call (a prefix of
    ``<tool_call>``) and must wait for the next piece."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
