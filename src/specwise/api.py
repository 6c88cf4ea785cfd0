"""The public entry point: :func:`generate`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specwise.drafters import METHODS, Drafter
from specwise.drafters.base import warn_renamed
from specwise.drafters.checkpoint import read_config
from specwise.engine.loop import speculative_generate
from specwise.engine.sampling import SamplingConfig
from specwise.engine.types import GenerationResult
from specwise.errors import ConfigError, PromptError


def build_drafter(target, method: str, **options: Any) -> Drafter:
    """Instantiate the drafter registered as ``method`` with its typed options.

    Raises:
        DrafterError: unknown method (the message lists the available ones) or a bad drafter.
        ConfigError: an option the method does not take, or out of range.
    """
    spec = METHODS.get(method)
    return spec.factory(target, spec.make_config(**options))


def load_drafter(path: str | Path, target, **options):
    """Build the drafter stored in ``path`` for ``target``.

    Args:
        path: a drafter directory (``config.json`` + ``model.safetensors``).
        target: the :class:`specwise.engine.target.Target`.
        **options: the method's options (e.g. ``num_draft_tokens``; not ``drafter_path``, which is ``path``).

    Returns:
        a :class:`specwise.drafters.base.Drafter`.

    Raises:
        DrafterError: not a drafter, missing weights, or trained for another target.
        ConfigError: an option the method does not take.
    """
    config = read_config(path)
    spec = METHODS.get(config["method"])
    return spec.factory(target, spec.make_config(drafter_path=str(path), **options))


def generate(
    target,
    prompt: str | Sequence[int] | torch.Tensor,
    *,
    method: str = "ar",
    drafter: Drafter | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    streamer: Callable[[list[int]], None] | None = None,
    text_streamer: Callable[[str], None] | None = None,
    **method_options: Any,
) -> GenerationResult:
    """Generate text with lossless speculative decoding.

    The output is what the target alone would produce: the same tokens under greedy decoding, the
    same distribution under sampling.

    Args:
        target: a :class:`specwise.engine.target.Target` (see :func:`specwise.load_target`).
        prompt: text (tokenized with the target's tokenizer, BOS added) or token ids.
        method: a registered method name (``ar``, ``pld``, ``draft``, ...); ignored when
            ``drafter`` is given.
        drafter: an already built drafter, reused across calls (it is reset per call). The weights
            of a trained method are the method option ``drafter_path`` (``--drafter PATH``); a path
            given here is still read as that (deprecated).
        max_new_tokens: number of new tokens, >= 1 (fewer if an EOS or stop string comes first).
        temperature: 0 for greedy decoding.
        top_k: 0 = off. top_p: in (0, 1]. repetition_penalty: 1 = off.
        seed: seeds the sampling RNG (a ``torch.Generator`` on the target's device).
        stop: a stop string or several, matched on the new text decoded with special tokens (so
            ``"<|im_end|>"`` works); generation ends at the token that completes one, and ``text``
            ends right after it (it is kept).
        streamer: called with each step's new token ids as they are committed.
        text_streamer: called with each new piece of text (``str``) as stop strings see it
            (special tokens kept, a final EOS left out); a tail that could still begin a stop
            string is held back until it cannot, so it never shows text past a stop string. The
            pieces add up to ``text`` unless special tokens were skipped from it.
        **method_options: the method's options, e.g. ``num_draft_tokens=8``, ``drafter_path=PATH``.

    Returns:
        :class:`GenerationResult` with ``text``, ``token_ids``, ``stats`` (:class:`SpecStats`),
        ``finish_reason`` (``stop`` / ``length`` / ``eos``) and ``stop_string``.

    Raises:
        PromptError: empty prompt, or prompt + ``max_new_tokens`` beyond the target's context.
        ConfigError: options out of range. DrafterError: unknown method or bad drafter.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, repetition_penalty)
    if isinstance(stop, str):
        stop = (stop,)
    if any(not isinstance(s, str) or not s for s in stop):
        raise ConfigError("stop strings must be non-empty strings.")
    if isinstance(drafter, (str, os.PathLike)):
        warn_renamed("generate", "drafter=PATH", "drafter_path=PATH")
        if "drafter_path" in method_options:
            raise ConfigError("give drafter_path or a path as drafter, not both.")
        method_options["drafter_path"] = os.fspath(drafter)
        drafter = None
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    prompt_ids = _prompt_ids(target, prompt)
    if prompt_ids.numel() + max_new_tokens > target.max_context:
        raise PromptError(
            f"the prompt has {prompt_ids.numel()} tokens and {max_new_tokens} new tokens were asked for, "
            f"but the target's context holds {target.max_context} tokens."
        )
    if drafter is None:
        drafter = build_drafter(target, method, **method_options)
    elif method_options:
        raise ConfigError("method options cannot be combined with an already built drafter.")
    generator = None
    if not sampling.is_greedy or seed is not None:
        generator = torch.Generator(device=target.device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    return speculative_generate(
        target, drafter, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
        generator=generator, stop_strings=stop, streamer=streamer, text_streamer=text_streamer,
    )


def _prompt_ids(target, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("the prompt is empty.")
        ids = target.encode(prompt)
    else:
        ids = torch.as_tensor(list(prompt) if not isinstance(prompt, torch.Tensor) else prompt, dtype=torch.long)
        ids = ids.reshape(-1).to(target.device)
    if ids.numel() == 0:
        raise PromptError("the prompt is empty.")
    if int(ids.min()) < 0 or int(ids.max()) >= target.vocab_size:
        raise PromptError(f"prompt token ids must lie in [0, {target.vocab_size}), the target's vocabulary.")
    return ids
