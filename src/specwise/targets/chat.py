"""Chat prompts through the target's own chat template, and the tokens that end an assistant turn."""

from __future__ import annotations

from functools import cached_property
from typing import Any, Sequence

import torch

from specwise.errors import PromptError
from specwise.targets.tool_calls import ToolError, supports_tools, template_tool_calls

ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "\x00specwise-turn\x00"  # a content no template alters and no tokenizer merges with its neighbours


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages in OpenAI's shape.

    Args:
        messages: a non-empty sequence of ``{"role": ..., "content": str}`` mappings; ``role`` one of
            :data:`ROLES`. An assistant message may carry OpenAI's ``tool_calls`` (its content then
            may be ``None``), a tool message its ``tool_call_id``; any message a ``name``.

    Returns:
        the messages as a list of plain dicts: ``role`` and ``content``, and those of ``tool_calls``
        (their arguments as objects, as chat templates read them), ``tool_call_id`` and ``name``
        that were given.

    Raises:
        PromptError: not a list of such mappings, an unknown role, a content that is not a string,
            a malformed tool call, or no message with non-blank content or a tool call.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("messages must be a non-empty list of {'role': ..., 'content': ...} mappings.")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or (
                "content" not in message and not message.get("tool_calls")):
            raise PromptError(f"message {i} must be a mapping with 'role' and 'content', got {message!r:.80}.")
        role, content = message["role"], message.get("content")
        if role not in ROLES:
            raise PromptError(f"message {i} has role {role!r}; use one of {', '.join(ROLES)}.")
        calls = message.get("tool_calls")
        if content is None and role == "assistant" and calls:
            content = ""
        if not isinstance(content, str):
            raise PromptError(f"message {i}'s content must be a string, got {type(content).__name__}.")
        entry: dict[str, Any] = {"role": role, "content": content}
        if calls:
            if role != "assistant":
                raise PromptError(f"message {i} has tool_calls, which only an assistant message may carry.")
            try:
                entry["tool_calls"] = template_tool_calls(calls, i)
            except ToolError as exc:
                raise PromptError(str(exc)) from None
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise PromptError(f"message {i}'s {key} must be a string.")
                entry[key] = message[key]
        checked.append(entry)
    if not any(m["content"].strip() or m.get("tool_calls") for m in checked):
        raise PromptError("the messages are empty: every content is blank.")
    return checked


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], name: str,
                    tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, with the generation
    prompt (the opening of the assistant's turn) appended: exactly what
    ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)``
    gives.

    Args:
        tokenizer: the target's tokenizer. messages: as :func:`check_messages` returns.
        name: the target's name, for the error message.
        tools: OpenAI's tool definitions for the template to render, or ``None``.

    Raises:
        PromptError: the tokenizer has no chat template, tools for a template that does not render
            them as ``<tool_call>`` blocks, or the template refuses the messages (for instance a role
            order it does not allow; the template's own message is quoted).
    """
    if not has_chat_template(tokenizer):
        raise PromptError(f"target {name} has no chat template, so it cannot take messages; pass a text prompt.")
    check_template_takes_tools(tokenizer, name, tools)
    try:
        ids = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None,
                                            add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # jinja's TemplateError (raise_exception in the template), or a bad render
        raise PromptError(f"the chat template of {name} refused the messages: {exc}") from None
    if hasattr(ids, "keys"):  # a BatchEncoding where return_dict defaults to True
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def check_template_takes_tools(tokenizer, name: str, tools: Sequence[dict] | None) -> None:
    """Refuse ``tools`` for a chat template that does not write calls as ``<tool_call>`` blocks.

    Raises:
        PromptError: naming the target (``name``) and the template it would need.
    """
    if tools and not supports_tools(tokenizer):
        raise PromptError(f"the chat template of {name} does not write tool calls as <tool_call> blocks "
                          "(as Qwen2.5's does), so it cannot take tools.")


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The special tokens the chat template writes right after an assistant's content (Qwen's
    ``<|im_end|>``, Gemma's ``<end_of_turn>``): where a chat reply ends. Read from the template itself,
    so that no model's tokens are hard-coded; empty without a template.

    The template renders one user and one assistant turn around a sentinel content; the special
    tokens among the first tokens after the sentinel are the end of the turn.
    """
    if not has_chat_template(tokenizer):
        return frozenset()
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(turn, tokenize=False)
    except Exception:  # a template that needs more than a user and an assistant turn
        return frozenset()
    _, found, tail = text.partition(_SENTINEL)
    if not found:
        return frozenset()
    special = set(tokenizer.all_special_ids) | {
        int(i) for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(token, "special", False)}
    ids = tokenizer.encode(tail, add_special_tokens=False)[:4]  # the closing marker, a newline or two
    return frozenset(next(([token] for token in ids if token in special), []))


class TextCodec:
    """The text side every target shares: prompts and chat messages to token ids, ids back to text,
    and the tokens that end an assistant's turn, all through the target's Hugging Face tokenizer.

    A base class, not a component of its own: a target that inherits it provides ``tokenizer`` (a
    ``PreTrainedTokenizerBase``), ``name`` (for messages) and ``device`` (a ``torch.device`` the
    ids are put on). It keeps nothing per generation; the one thing it caches is
    :attr:`end_of_turn_ids`, read from the chat template once per target.
    """

    def encode(self, text: str) -> torch.Tensor:
        """A prompt's token ids, ``[T]`` long on :attr:`device`, with the model's special prefix
        (e.g. BOS) as the tokenizer adds it."""
        return self.tokenizer(text, return_tensors="pt").input_ids[0].to(self.device)

    def encode_chat(self, messages, tools=None) -> torch.Tensor:
        """Token ids of chat ``messages`` through the target's chat template, the assistant's turn
        opened (:func:`chat_prompt_ids`). Returns ``[T]`` long on :attr:`device`.

        Raises:
            PromptError: malformed messages, a target without a chat template, or ``tools`` (OpenAI's
                tool definitions, rendered by the template) for a template that cannot take them.
        """
        ids = chat_prompt_ids(self.tokenizer, check_messages(messages), self.name, tools)
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def decode(self, token_ids, special_tokens: bool = False) -> str:
        """Token ids (a sequence of ints or a 1-D tensor) to text, special tokens skipped unless
        ``special_tokens``."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=not special_tokens)

    @cached_property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Tokens that close an assistant turn in the chat template (:func:`end_of_turn_ids`; empty
        without one): a chat generation ends at these as at ``eos_token_ids``."""
        return end_of_turn_ids(self.tokenizer)
