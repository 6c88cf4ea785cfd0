"""Chat prompts through the target's own chat template, and the tokens that end an assistant turn."""

from __future__ import annotations

from typing import Any, Sequence

from specwise.errors import PromptError

ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "\x00specwise-turn\x00"  # a content no template alters and no tokenizer merges with its neighbours


def check_messages(messages: Any) -> list[dict[str, str]]:
    """Validate chat messages in OpenAI's shape.

    Args:
        messages: a non-empty sequence of ``{"role": ..., "content": str}`` mappings; ``role`` one of
            :data:`ROLES`.

    Returns:
        the messages as a list of plain dicts (``role`` and ``content`` only).

    Raises:
        PromptError: not a list of such mappings, an unknown role, a content that is not a string,
            or no message with non-blank content.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise PromptError("messages must be a non-empty list of {'role': ..., 'content': ...} mappings.")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise PromptError(f"message {i} must be a mapping with 'role' and 'content', got {message!r:.80}.")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise PromptError(f"message {i} has role {role!r}; use one of {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise PromptError(f"message {i}'s content must be a string, got {type(content).__name__}.")
        checked.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in checked):
        raise PromptError("the messages are empty: every content is blank.")
    return checked


def has_chat_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], name: str) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, with the generation
    prompt (the opening of the assistant's turn) appended: exactly what
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` gives.

    Args:
        tokenizer: the target's tokenizer. messages: as :func:`check_messages` returns.
        name: the target's name, for the error message.

    Raises:
        PromptError: the tokenizer has no chat template, or the template refuses the messages (for
            instance a role order it does not allow; the template's own message is quoted).
    """
    if not has_chat_template(tokenizer):
        raise PromptError(f"target {name} has no chat template, so it cannot take messages; pass a text prompt.")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # jinja's TemplateError (raise_exception in the template), or a bad render
        raise PromptError(f"the chat template of {name} refused the messages: {exc}") from None
    if hasattr(ids, "keys"):  # a BatchEncoding where return_dict defaults to True
        ids = ids["input_ids"]
    return [int(i) for i in ids]


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
