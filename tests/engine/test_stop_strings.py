"""Stop strings end the text right after the match, see special tokens, and never leak through a stream.

The contract: stop strings are matched on the new text as the tokenizer decodes it *with* special
tokens; ``text`` ends right after the matched stop string (kept); ``token_ids`` run up to and
including the token that completed it; ``finish_reason`` is ``stop`` / ``length`` / ``eos`` and
``stop_string`` names the match. The text streamer's deltas add up to ``text`` and never show a tail
that could still begin a stop string. With the oracle drafter accepting everything, the prefill emits
new token 0 and step s emits tokens ``1 + s(k+1) .. (s+1)(k+1)``.
"""

from __future__ import annotations

import pytest

import specwise
from conftest import OracleDrafter, greedy_continuation, make_target, random_prompt
from specwise import cli
from specwise.commands import generate as generate_command
from specwise.engine.stopping import IncrementalText, StoppingRules
from specwise.targets.hf import Target

PROMPT = random_prompt(10, seed=1)
N = 14


def _continuation(n: int = N) -> list[int]:
    return list(greedy_continuation("llama", 0, tuple(PROMPT.tolist()), n))


def _special_text(target, ids) -> str:
    return target.tokenizer.decode(list(ids), skip_special_tokens=False)


def _reference(target, continuation, stops, max_new_tokens):
    """The slow oracle: the shortest prefix whose text holds a stop string, and the text cut after it."""
    for end in range(1, max_new_tokens + 1):
        text = _special_text(target, continuation[:end])
        hits = [(text.find(s) + len(s), s) for s in stops if s in text]
        if hits:
            cut, stop = min(hits)
            return continuation[:end], text[:cut], stop
    return continuation[:max_new_tokens], _special_text(target, continuation[:max_new_tokens]), None


def _run(target, stops, *, k: int | None, max_new_tokens: int = N, include_stop: bool = True):
    continuation = _continuation()
    deltas: list[str] = []
    drafter = dict(method="ar") if k is None else dict(drafter=OracleDrafter(continuation, len(PROMPT), k))
    result = specwise.generate(target, PROMPT, max_new_tokens=max_new_tokens, stop=stops,
                               text_streamer=deltas.append, include_stop=include_stop, **drafter)
    ids, text, stop = _reference(target, continuation, stops, max_new_tokens)
    if stop and not include_stop:
        text = text[: len(text) - len(stop)]
    assert result.token_ids == ids
    assert result.text == (text if stop else target.decode(ids))  # special tokens kept only after a stop
    assert result.stop_string == stop
    assert result.finish_reason == ("stop" if stop else "length")
    assert result.stop_reason == ("stop_string" if stop else "length")
    assert "".join(deltas) == text
    assert all(deltas)
    return result


def _token_spans(target, ids):
    """(start, end) character span of each token in the decoded text."""
    spans, start = [], 0
    for i in range(len(ids)):
        end = len(_special_text(target, ids[: i + 1]))
        spans.append((start, end))
        start = end
    return spans


@pytest.mark.parametrize("include_stop", [True, False])
@pytest.mark.parametrize("k", [None, 1, 3, 8])
@pytest.mark.parametrize("index", [0, 3, 4, 5, 9])
def test_a_stop_string_ending_at_every_character_of_a_token(index, k, include_stop):
    """The stop string starts two tokens earlier and ends at each character offset of token ``index``
    (with k=3, token 4 closes step 0 and token 5 opens step 1): the text must end exactly there, or,
    with ``include_stop=False`` (OpenAI's ``stop``), right before the stop string, in the text and the
    streamed pieces alike; the tokens still run up to the one that completed it."""
    target = make_target("llama", eos=())
    continuation = _continuation()
    text = _special_text(target, continuation)
    start, end = _token_spans(target, continuation)[index]
    first = _token_spans(target, continuation)[max(index - 2, 0)][0]
    for cut in range(start + 1, end + 1):
        stop = text[first:cut]
        result = _run(target, [stop], k=k, include_stop=include_stop)
        if include_stop:
            assert result.text.endswith(stop)
        else:
            assert result.text == text[:first]
        assert result.token_ids[-1] == continuation[index]


def test_the_completing_token_does_not_leak_past_the_stop_string():
    """The issue's case: a stop string ending inside a token gives text ending at the stop, not the token."""
    target = make_target("llama", eos=())
    continuation = _continuation()
    text = _special_text(target, continuation[:6])
    stop = text[:-2]  # ends two characters before token 5 ends
    for k in (None, 2, 5):
        result = _run(target, [stop], k=k)
        assert result.text == stop and result.token_ids == continuation[:6]


@pytest.mark.parametrize("k", [None, 3])
def test_a_plain_stop_string_straddling_two_steps(k):
    """With k=3 token 4 is the bonus of step 0 and token 5 the first draft of step 1."""
    target = make_target("llama", eos=())
    continuation = _continuation()
    t4, t5 = _special_text(target, [continuation[4]]), _special_text(target, [continuation[5]])
    result = _run(target, [t4[-2:] + " " + t5[:2]], k=k)
    assert result.token_ids == continuation[:6]


@pytest.mark.parametrize("k", [None, 3, 8])
@pytest.mark.parametrize("max_new_tokens", [5, 6, 7])
def test_stop_strings_with_the_length_cap(max_new_tokens, k):
    """The stop completes in token 5: before the cap (7), at it (6), or after it (5: never fires)."""
    target = make_target("llama", eos=())
    continuation = _continuation()
    stop = _special_text(target, continuation[4:6])[:-1]
    result = _run(target, [stop], k=k, max_new_tokens=max_new_tokens)
    assert result.finish_reason == ("length" if max_new_tokens == 5 else "stop")


@pytest.mark.parametrize("k", [None, 1, 4])
def test_a_special_token_stop_string_fires(k):
    """A token the tokenizer marks special (as ``<|im_end|>`` / ``<end_of_turn>`` are) stops generation."""
    target = make_target("llama", eos=())
    continuation = _continuation()
    special = f"t{continuation[6]}"
    assert continuation[6] not in continuation[:6]
    target.tokenizer.add_special_tokens({"additional_special_tokens": [special]})
    assert target.decode([continuation[6]]) == ""  # skipped by the plain decoding
    result = _run(target, [special], k=k)
    assert result.token_ids == continuation[:7] and result.text.endswith(special)


def test_finish_reason_eos_and_its_text():
    continuation = _continuation()
    target = make_target("llama", eos=[continuation[3]])
    assert continuation[3] not in continuation[:3]
    result = specwise.generate(target, PROMPT, max_new_tokens=N, stop=["no such text"])
    assert result.finish_reason == "eos" and result.stop_reason == "eos" and result.stop_string is None
    assert result.token_ids == continuation[:4]


def test_the_earliest_ending_stop_string_is_the_one_reported():
    target = make_target("llama", eos=())
    continuation = _continuation()
    late, early = _special_text(target, [continuation[8]]), _special_text(target, continuation[2:4])
    result = _run(target, [late, early], k=8)
    assert result.stop_string == early


# ------------------------------------------------------------------------------------------
# the text streamer and incremental decoding, on hand-made decodings


def _letters(ids) -> str:
    return "".join(chr(ord("a") + int(i)) for i in ids)


def test_the_text_streamer_holds_back_what_could_begin_a_stop_string():
    deltas: list[str] = []
    rules = StoppingRules(_letters, frozenset(), max_new_tokens=20, stop_strings=("cde",),
                          text_streamer=deltas.append)
    rules.commit([0, 1, 2])  # "abc": "c" could begin "cde"
    assert "".join(deltas) == "ab"
    rules.commit([3])  # "abcd": still
    assert "".join(deltas) == "ab"
    rules.commit([5])  # "abcdf": a false start, released
    assert "".join(deltas) == "abcdf"
    rules.commit([2, 3, 4, 5, 6])  # "cde" completes at token 4; "fg" never shows
    assert "".join(deltas) == "abcdfcde" and rules.text == "abcdfcde"
    assert rules.tokens == [0, 1, 2, 3, 5, 2, 3, 4] and rules.stop_string == "cde"


def _utf8(ids) -> str:
    """Each token is one byte (a stand-in for byte-fallback tokens)."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stops", [(), ("zz",)])
def test_a_text_cut_mid_character_keeps_its_tail(stops):
    deltas: list[str] = []
    e_acute = list("é".encode())
    rules = StoppingRules(_utf8, frozenset(), max_new_tokens=3, stop_strings=stops, text_streamer=deltas.append)
    rules.commit([ord("a")])
    rules.commit(e_acute[:1])
    assert "".join(deltas) == "a"  # an incomplete character waits
    rules.commit(e_acute[1:] + [ord("b")])
    assert rules.stop_reason == "length" and rules.text == "aé" == "".join(deltas)
    got: list[str] = []
    rules = StoppingRules(_utf8, frozenset(), max_new_tokens=2, stop_strings=stops, text_streamer=got.append)
    rules.commit([ord("a")])
    rules.commit(e_acute)  # the length limit cuts "é" after its first byte
    assert rules.text == "a\ufffd" and "".join(got) == "a\ufffd"


def test_a_text_that_really_ends_in_a_replacement_character_keeps_it():
    got: list[str] = []
    rules = StoppingRules(_utf8, frozenset(), max_new_tokens=4, stop_strings=(), text_streamer=got.append)
    for byte in "a\ufffd".encode():
        rules.commit([byte])
    assert rules.stop_reason == "length" and "".join(got) == rules.text == "a\ufffd"


def test_decoding_is_incremental():
    """No step decodes the whole output again (that is quadratic in its length)."""
    lengths: list[int] = []

    def decode(ids):
        lengths.append(len(ids))
        return _letters(ids)

    got: list[str] = []
    rules = StoppingRules(decode, frozenset(), max_new_tokens=400, stop_strings=("zzz",), text_streamer=got.append)
    for i in range(400):
        rules.commit([i % 20])
    assert max(lengths) <= 4
    assert rules.text == _letters([i % 20 for i in range(400)]) == "".join(got)


def test_incremental_text_matches_a_full_decoding_of_a_real_tokenizer():
    target = make_target("llama", eos=())
    continuation = _continuation()
    text = IncrementalText(lambda ids: _special_text(target, ids))
    for i in range(0, N, 3):
        text.extend(continuation[i: i + 3])
    assert text.text + text.pending() == _special_text(target, continuation)


# ------------------------------------------------------------------------------------------
# the CLI's streamer


class _ByteTarget(Target):
    """The tiny target with each token decoded as one byte; ``lead`` decodes to a UTF-8 lead byte."""

    lead = -1

    def decode(self, token_ids, special_tokens: bool = False) -> str:
        raw = bytes(0xC3 if t == self.lead else ord("a") + t % 26 for t in token_ids)
        return raw.decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop", [[], ["zzzz"]])
def test_the_cli_prints_a_tail_cut_mid_character(stop, monkeypatch, capsys):
    """The length limit cuts a character after its first byte: the U+FFFD it decodes to is printed."""
    plain = make_target("llama", eos=())
    target = _ByteTarget(plain.model, plain.tokenizer, "bytes")
    target.eos_token_ids = frozenset()
    prompt = " ".join(f"t{i}" for i in PROMPT.tolist())
    ids = specwise.generate(plain, prompt, max_new_tokens=5).token_ids
    target.lead = ids[-1]
    assert ids[-1] not in ids[:-1]
    monkeypatch.setattr(generate_command, "load_target", lambda *args, **kwargs: target)
    argv = ["generate", prompt, "--max-new-tokens", "5", "--device", "cpu"] + [a for s in stop for a in ("--stop", s)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(target.decode(ids) + "\n") and target.decode(ids).endswith("\ufffd")


def test_incremental_text_tail_and_restore():
    text = IncrementalText(_letters)
    for ids in ([0, 1], [2], [3, 4, 5]):
        text.extend(ids)
    assert (text.tail(4), text.tail(0), text.tail(99), text.length) == ("cdef", "", "abcdef", 6)
    state = text.state()
    text.extend([6, 7])
    text.restore(state)
    assert (text.tokens, text.text, text.pending()) == ([0, 1, 2, 3, 4, 5], "abcdef", "")
