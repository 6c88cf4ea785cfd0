"""Grammar-constrained decoding: the token mask a grammar puts on the target's distribution.

A grammar (a JSON schema, a regex, a context-free grammar) turns the target's distribution p at a
position into p′: the logits of the tokens the grammar refuses after that position's prefix become
``-inf`` *before* any other processing (repetition penalty, temperature, top-k, top-p; see
:mod:`specwise.engine.sampling`). Speculative decoding stays exact with respect to p′ when every
verified row is masked with its own prefix's mask, and a draft token the grammar refuses is a
*rejected* draft (p′ gives it probability 0): the token chosen there comes from the residual
``norm(max(p′ − q, 0))`` with the drafter's own q (docs/algorithms.md §1.4; Leviathan et al. 2023).

The masks come from llguidance (Microsoft's grammar engine made for token masks, with rollback;
the one llama.cpp, vLLM and SGLang use). :class:`GrammarCompiler` wraps a target's tokenizer once
(seconds for a 262k vocabulary), :class:`Grammar` is a compiled constraint any number of
generations share, and :class:`GrammarState` is one generation's matcher, owned by the loop.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from specwise.errors import ConfigError

#: the ``type`` values of a ``response_format``
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
#: the syntaxes a ``{"type": "grammar"}`` format may name: llguidance's Lark dialect (the default)
#: or llama.cpp's GBNF (translated to it)
GRAMMAR_SYNTAXES = ("lark", "gbnf")
#: JSON without needless whitespace: no space after ``,`` and ``:``, none between items
JSON_OPTIONS = {"item_separator": ",", "key_separator": ":", "whitespace_flexible": False}


class GrammarError(ConfigError):
    """A response format, schema, regex or grammar that cannot constrain generation."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency of the package; only a broken install lacks it
        raise ConfigError("constrained output needs the llguidance package: pip install llguidance.") from None
    return llguidance


def grammar_source(response_format: Mapping[str, Any] | None) -> str | None:
    """The llguidance grammar for a ``response_format``, or ``None`` for unconstrained text.

    Shapes (OpenAI's, plus two of llama.cpp's / vLLM's):
    ``{"type": "text"}``; ``{"type": "json_object"}`` (any JSON object);
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}``;
    ``{"type": "regex", "pattern": "..."}``; ``{"type": "grammar", "grammar": "...", "syntax":
    "lark" | "gbnf"}``. JSON is generated without needless whitespace (:data:`JSON_OPTIONS`);
    ``strict: false`` lets the compiler skip schema keywords it does not support instead of refusing them.

    Raises:
        GrammarError: not one of those shapes, or a field of the wrong type.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format must be an object with a 'type', got {response_format!r}.")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise GrammarError(f"response_format type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}.")
    matcher = _llguidance().LLMatcher
    if kind == "text":
        return None
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("a json_schema response_format needs a 'json_schema' object holding the 'schema'.")
        schema = spec.get("schema", {"type": "object"})
        strict = spec.get("strict", True)
        if not isinstance(schema, Mapping):
            raise GrammarError(f"json_schema.schema must be a JSON schema object, got {schema!r}.")
        if not isinstance(strict, bool) and strict is not None:
            raise GrammarError(f"json_schema.strict must be true or false, got {strict!r}.")
        try:
            return matcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS,
                                                    overrides={"lenient": strict is False})
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema is not valid: {_sentence(exc)}") from None
    text = response_format.get("pattern" if kind == "regex" else "grammar")
    field = "pattern" if kind == "regex" else "grammar"
    if not isinstance(text, str) or not text:
        raise GrammarError(f"a {kind} response_format needs a non-empty '{field}' string.")
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    syntax = response_format.get("syntax", "lark")
    if syntax not in GRAMMAR_SYNTAXES:
        raise GrammarError(f"grammar syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {syntax!r}.")
    if syntax == "gbnf":
        try:
            text = _llguidance().gbnf_to_lark(text)
        except Exception as exc:  # the translator raises plain exceptions on a bad GBNF
            raise GrammarError(f"the GBNF grammar is not valid: {_sentence(exc)}") from None
    return matcher.grammar_from_lark(text)


def unsupported_in_schema(schema: Mapping[str, Any]) -> str:
    """What of a JSON ``schema`` (read as a document of its own) the grammar engine cannot enforce,
    in its own words (e.g. ``Unimplemented keys: ["if", "then"]``), or ``''`` when it can all be."""
    matcher = _llguidance().LLMatcher
    try:
        failed, messages = matcher.validate_grammar_with_warnings(matcher.grammar_from_json_schema(schema), None)
    except (ValueError, TypeError) as exc:
        return _sentence(exc).rstrip(".")
    return (_sentence(messages[0]).rstrip(".") if messages else "an unsupported construct") if failed else ""


def _sentence(error: Exception | str) -> str:
    """An error message as the end of one sentence: its lines of words joined (a compiler's
    excerpts of the source and its carets left out), ending in a period."""
    lines = [line.strip() for line in str(error).splitlines()]
    words = [line for line in lines if re.search(r"[A-Za-z]", line) and not re.match(r"^\d+ \|", line)]
    text = " ".join(words)[:300].rstrip(" :") or type(error).__name__
    return text if text.endswith(".") else text + "."


class GrammarCompiler:
    """A target's tokenizer as llguidance reads it: built once per target, it compiles grammars.

    Args:
        tokenizer: the target's Hugging Face fast tokenizer.
        vocab_size: the width of the target's logits (it may exceed the tokenizer's tokens, as
            Qwen2.5's 151,936 rows do: the padding rows are never allowed).
        eos_token_ids: every token that may end a generation (EOS and end-of-turn tokens); the
            mask allows those a generation stops at where the grammar is complete.

    Raises:
        ConfigError: a tokenizer llguidance cannot read (a slow one, or one without a decoder).
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        _llguidance()
        from llguidance.hf import from_tokenizer

        eos = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        try:
            self.tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        except Exception as exc:  # llguidance raises ValueError or a bare Exception for an unknown tokenizer
            raise ConfigError(f"constrained output cannot read this target's tokenizer: {_sentence(exc)}") from None
        self.vocab_size = vocab_size
        self.eos_token_ids = torch.tensor(self.tokenizer.eos_tokens, dtype=torch.long)
        self.real_tokens = min(len(tokenizer), vocab_size)
        # special tokens (unknown, padding, BOS, chat markers) are text of no grammar: the grammar
        # engine would otherwise let the unknown token stand for bytes no other token spells
        self.special_token_ids = torch.tensor(
            sorted({t for t in tokenizer.all_special_ids if 0 <= t < vocab_size} | set(eos)), dtype=torch.long)

    def compile(self, response_format: Mapping[str, Any] | None) -> "Grammar | None":
        """The compiled grammar of a ``response_format`` (:func:`grammar_source`), ``None`` for text.

        Raises:
            GrammarError: a bad format, schema, regex or grammar (the compiler's reason in one
                sentence), or one whose first mask allows no token (it can never be satisfied).
        """
        source = grammar_source(response_format)
        if source is None:
            return None
        llguidance = _llguidance()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source, self.tokenizer)
        if failed:
            raise GrammarError(f"the {response_format['type']} response_format cannot be compiled: "
                               f"{_sentence(messages[0] if messages else 'unknown error')}")
        grammar = Grammar(self, source)
        state = grammar.start(frozenset(self.eos_token_ids.tolist()))
        if state.error() or not bool(state.chain([])[1][0].any()):
            raise GrammarError(f"the {response_format['type']} response_format allows no token at the start "
                               f"of the output: {_sentence(state.error() or 'it can never be satisfied')}")
        return grammar


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar, shared by any number of generations (each :meth:`start` s its own matcher)."""

    compiler: GrammarCompiler
    source: str

    def start(self, eos_token_ids: frozenset[int]) -> "GrammarState":
        """A new generation's matcher, before its first token.

        Args:
            eos_token_ids: the tokens this generation stops at (allowed where the grammar is
                complete; empty for a generation that ignores EOS).
        """
        matcher = _llguidance().LLMatcher(self.compiler.tokenizer, self.source, log_level=0)
        return GrammarState(self.compiler, matcher, eos_token_ids)


class GrammarState:
    """One generation's grammar matcher: masks for the rows a step verifies, drafts it refuses,
    tokens it forces, and the committed tokens it has consumed.

    Every query leaves the matcher where the committed tokens put it (it advances along a draft and
    rolls back); only :meth:`advance` moves it.
    """

    def __init__(self, compiler: GrammarCompiler, matcher, eos_token_ids: frozenset[int]) -> None:
        self.compiler = compiler
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self._eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long)
        self._special = frozenset(compiler.special_token_ids.tolist())
        self._ended = False  # an end token was committed
        words = (compiler.vocab_size + 31) // 32
        self._bits = torch.zeros(words, dtype=torch.int32)
        self._shifts = torch.arange(8, dtype=torch.uint8)

    def error(self) -> str:
        """The matcher's error ('' when none): a grammar that cannot be satisfied, or a limit hit."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def is_stopped(self) -> bool:
        """The grammar is complete and takes no more tokens, or an end token was committed
        (generation ends here)."""
        return self._ended or self.matcher.is_stopped()

    def _fill(self) -> None:
        """Compute the grammar's bitmask after what the matcher has consumed (into ``_bits``).

        Raises:
            GrammarError: the matcher cannot go on (:meth:`_stuck`).
        """
        try:
            self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        except Exception as exc:  # noqa: BLE001 - llguidance raises plain errors holding its whole state
            raise self._stuck(exc) from None
        if self.matcher.is_error():
            raise self._stuck()

    def _stuck(self, exc: Exception | None = None) -> GrammarError:
        """The one-sentence error for a matcher that cannot go on (a grammar that outgrew the
        parser's limits mid-generation): the library's first line only, never its dump of the
        grammar and parser state."""
        detail = (self.error() or str(exc or "")).strip().splitlines()
        reason = detail[0][:160].rstrip(" .:") if detail else "no reason given"
        return GrammarError(f"the response_format's grammar cannot be continued here (the grammar engine "
                            f"says: {reason}); simplify the schema or grammar.")

    def _allows(self, token: int) -> bool:
        """Whether the last :meth:`_fill`'s mask allows ``token`` (an end token: where the grammar
        is complete and this generation stops at it)."""
        if token in self.eos_token_ids:
            return self.matcher.is_accepting()
        if token in self._special or not 0 <= token < self.compiler.real_tokens:
            return False
        return bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)

    def _mask(self) -> torch.Tensor:
        """``[V]`` bool: the tokens the last :meth:`_fill`'s mask allows (:meth:`_allows` for each)."""
        bytes_ = self._bits.view(torch.uint8)
        mask = ((bytes_[:, None] >> self._shifts) & 1).flatten()[: self.compiler.vocab_size].bool()
        mask[self.compiler.real_tokens:] = False
        eos = self.compiler.eos_token_ids
        mask[self.compiler.special_token_ids] = False
        if self.matcher.is_accepting() and self._eos.numel():
            mask[self._eos] = True
        elif self.matcher.is_stopped() and not bool(mask.any()):
            # nothing may follow; the loop ends the generation before it commits this row's token,
            # which still needs a distribution to come from
            mask[eos] = True
        return mask

    def _after_end(self) -> torch.Tensor:
        """The mask of a row after an end token: nothing follows it, so only end tokens (the
        generation stops there before that row's token is committed)."""
        mask = torch.zeros(self.compiler.vocab_size, dtype=torch.bool)
        mask[self._eos if self._eos.numel() else self.compiler.eos_token_ids] = True
        return mask

    def _consume(self, token: int) -> None:
        # end tokens never reach the matcher: nothing follows them, and rolling the matcher back
        # past one does not always restore its state
        try:
            consumed = self.matcher.consume_token(token)
        except Exception as exc:  # noqa: BLE001 - see _fill
            raise self._stuck(exc) from None
        if not consumed:
            if self.matcher.is_error():
                raise self._stuck()
            raise ValueError(f"the grammar refuses token {token}")

    def chain(self, tokens: Sequence[int]) -> tuple[int, torch.Tensor]:
        """How many leading draft ``tokens`` the grammar allows one after another, and the masks
        of the rows verifying them.

        Returns:
            ``(K, masks)``: K allowed tokens (an end token ends them), ``masks`` ``[K+1, V]`` bool:
            after the committed tokens, then after each allowed token (row K is where the first
            refused token would have been verified, or the bonus token's).
        """
        masks, consumed = [], 0
        for token in tokens:
            self._fill()
            masks.append(self._mask())
            if not self._allows(token):
                break
            if token in self.eos_token_ids:
                self.matcher.rollback(consumed)
                return consumed + 1, torch.stack(masks + [self._after_end()])
            self._consume(token)
            consumed += 1
        if len(masks) == consumed:
            self._fill()
            masks.append(self._mask())
        self.matcher.rollback(consumed)
        return consumed, torch.stack(masks)

    def valid_nodes(self, tokens: Sequence[int], children: Sequence[Sequence[int]]) -> list[bool]:
        """Which nodes of a draft tree the grammar allows along their paths (node 0 = the root,
        always allowed; a node under a refused one is refused).

        Args:
            tokens: ``n`` token ids per node. children: per node, its child nodes.
        """
        allowed = [False] * len(tokens)
        allowed[0] = True
        stack = [(0, False)]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self.matcher.rollback(1)
                continue
            if node and tokens[node] in self.eos_token_ids:
                continue  # allowed (its parent's mask said so); nothing follows it
            if node:
                self._consume(tokens[node])
                stack.append((node, True))
            if not children[node]:
                continue
            self._fill()
            ok = [child for child in children[node] if self._allows(tokens[child])]
            for child in reversed(ok):
                allowed[child] = True
                stack.append((child, False))
        return allowed

    def node_masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """The mask after each of ``paths`` (token sequences from the committed tokens on; each one
        the grammar allows, an empty one = the root).

        Returns:
            ``[len(paths), V]`` bool.
        """
        masks = []
        for path in paths:
            if path and path[-1] in self.eos_token_ids:
                masks.append(self._after_end())
                continue
            for token in path:
                self._consume(token)
            self._fill()
            masks.append(self._mask())
            self.matcher.rollback(len(path))
        return torch.stack(masks)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (its fast-forward tokens: the canonical tokenization of
        the only text that can follow); deterministic drafts that need no drafter."""
        if self.matcher.is_stopped():
            return []
        try:
            return self.matcher.compute_ff_tokens()
        except Exception as exc:  # noqa: BLE001 - see _fill
            raise self._stuck(exc) from None

    def advance(self, tokens: Sequence[int]) -> int:
        """Consume committed tokens, up to where the grammar stops.

        Returns:
            how many of ``tokens`` belong to the output: all of them, or those up to the one after
            which the grammar is complete and takes no more (the rest are left out).

        Raises:
            ValueError: a token the grammar refuses (verification masks every row, so only a bug
                in the caller can get here).
        """
        for i, token in enumerate(tokens):
            if self.is_stopped():
                return i
            self._fill()
            if not self._allows(token):
                raise ValueError(f"the grammar refuses committed token {token}")
            if token in self.eos_token_ids:
                self._ended = True
            else:
                self._consume(token)
        return len(tokens)
