"""What a benchmark runs: specwise methods and Hugging Face ``generate`` peers behind one callable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import GenerationConfig

from specwise.api import build_drafter, generate
from specwise.drafters.base import METHODS
from specwise.drafters.checkpoint import is_checkpoint, shipped_drafter
from specwise.drafters.spec import split_spec
from specwise.errors import ConfigError, DrafterError
from specwise.lab.bench.llamacpp import LlamaServer
from specwise.methods.draft.drafter import load_draft_lm
from specwise.models.export import to_hf_model
from specwise.targets.aliases import KNOWN_TARGETS
from specwise.targets.files import gguf_born, gguf_file, load_model_and_tokenizer


@dataclass
class Outcome:
    """One generation as the benchmark sees it (times in seconds)."""

    token_ids: list[int]
    wall_time_s: float
    stats: Any = None  # SpecStats for specwise methods, None for peers
    decode_time_s: float | None = None  # decoding without the prefill, where a peer reports it (llama.cpp)


@dataclass(frozen=True)
class Contender:
    """A named way to generate: ``run(prompt_ids [P] long, max_new_tokens, sampling kwargs) -> Outcome``."""

    name: str
    run: Callable[..., Outcome]
    is_peer: bool = False
    #: how the contender ran, for the report (a peer's command line and build), once it has run
    describe: Callable[[], str] | None = None
    #: ``run`` takes ``cache_prompt=True``: keep the prompt's cache for the next request that
    #: continues it (llama-server's own option; a conversation's turns)
    caches_prompts: bool = False
    #: drop what earlier requests taught it (a drafting index across requests, llama-server's shared
    #: n-gram pool), so a repeat of the race starts where the first did; ``None``: nothing to drop
    forget: Callable[[], None] | None = None


def specwise_contender(target, method: str, label: str | None = None, constrained: bool = True,
                       draft_budget: str = "measured", **options: Any) -> Contender:
    """A specwise method with fixed options; its drafter is built once and reused. With
    ``constrained=False`` (``ar[constrained=false]``) it ignores the run's ``response_format``: the
    unconstrained reference a constrained run's mask cost is measured against. ``draft_budget``
    is :func:`specwise.generate`'s (``eagle[draft_budget=fixed]``: the method's own draft sizes).

    A method that drafts across requests (``suffix``, ``auto``) reads and fills an index of its
    own, scoped by the contender's name unless ``scope`` is given: contenders on one target never
    draft from each other's outputs (on the same prompt they would copy one another's text)."""

    scoped = "scope" in METHODS.get(method).option_names
    if scoped and "scope" not in options:
        options = {**options, "scope": f"bench:{label or method}"}
    drafters = [build_drafter(target, method, **options)]

    def run(prompt_ids, max_new_tokens, temperature=0.0, seed=None, response_format=None, **sampling):
        result = generate(target, prompt_ids, drafter=drafters[-1], max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed, response_format=response_format if constrained else None,
                          draft_budget=draft_budget, **sampling)
        return Outcome(result.token_ids, result.stats.wall_time_s, result.stats)

    def forget() -> None:  # a scope of its own per repeat: an index that has seen none of the texts
        drafters.append(build_drafter(target, method, **{**options, "scope": f"{options['scope']}#{len(drafters)}"}))

    return Contender(label or method, run, forget=forget if scoped else None)


def hf_contender(target, kind: str, label: str | None = None, **options: Any) -> Contender:
    """A Hugging Face ``generate`` peer on the same model object.

    Args:
        kind: ``"generate"`` (plain), ``"pld"`` (prompt lookup; options ``prompt_lookup_num_tokens``,
            ``max_matching_ngram_size``) or ``"assisted"`` (option ``assistant``: a draft model
            path, or ``assistant_model``: a loaded model).
    """

    model = target.model
    eos = sorted(target.eos_token_ids)
    extra: dict[str, Any] = {}
    lookup: dict[str, Any] = {}
    if kind == "pld":
        lookup["prompt_lookup_num_tokens"] = int(options.get("prompt_lookup_num_tokens", 10))
        lookup["max_matching_ngram_size"] = int(options.get("max_matching_ngram_size", 2))
    elif kind == "assisted":
        assistant = options.get("assistant_model")
        if assistant is None:
            if "assistant" not in options:
                raise ConfigError("hf-assisted needs an assistant draft model: hf-assisted[assistant=PATH].")
            assistant = load_assistant(target, str(options["assistant"]))
        extra["assistant_model"] = assistant
    elif kind != "generate":
        raise ConfigError(f"unknown Hugging Face peer {kind!r}; use generate, pld or assisted.")

    @torch.inference_mode()
    def run(prompt_ids, max_new_tokens, temperature=0.0, seed=None, top_k=0, top_p=1.0, repetition_penalty=1.0,
            ignore_eos=False, response_format=None):
        if response_format is not None:
            raise ConfigError("the Hugging Face peers cannot constrain their output; leave them out of a run "
                              "with --json-schema.")
        sample = temperature > 0 and top_k != 1
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
            top_k=(top_k or None) if sample else None, top_p=top_p if sample else None,
            repetition_penalty=repetition_penalty if repetition_penalty != 1.0 else None,
            eos_token_id=eos, pad_token_id=target.tokenizer.pad_token_id or 0,
            min_new_tokens=max_new_tokens if ignore_eos else None, **lookup,
        )
        if seed is not None:
            torch.manual_seed(seed)
        ids = prompt_ids[None]
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, **extra)
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        return Outcome(out[0, prompt_ids.numel():].tolist(), wall)

    return Contender(label or f"hf-{kind}", run, is_peer=True)


def load_assistant(target, path: str):
    """The HF model for ``hf-assisted[assistant=PATH]``: an HF directory or ``.gguf``, a specwise draft
    LM (materialized as a plain HF model with the full vocabulary), or ``default`` for the draft LM
    that ships for the target.

    Raises:
        DrafterError: ``default`` but no draft LM ships for the target; or a bad checkpoint.
    """

    if path == "default":
        shipped = shipped_drafter(target, "draft")
        if shipped is None:
            raise DrafterError(f"no draft LM ships for {target.name}; give hf-assisted[assistant=PATH].")
        path = str(shipped)
    if is_checkpoint(path):
        return to_hf_model(load_draft_lm(path, target), target)

    # a GGUF-born assistant takes the target's weight form, as specwise's own draft model does
    weights = target.weights if gguf_born(path) else None
    return load_model_and_tokenizer(path, dtype=target.dtype, device=target.device, role="draft model",
                                    weights=weights)[0]


def hf_peer_specs(specs: list[str]) -> list[str]:
    """The Hugging Face peers for a benchmark: plain generate, prompt lookup, and assisted generation
    with the draft model of every ``draft`` contender (``default``: the shipped one)."""
    peers = ["hf-generate", "hf-pld"]
    for spec in specs:
        name, options = split_spec(spec)
        if name == "draft":
            peers.append(f"hf-assisted[assistant={options.get('drafter_path', options.get('drafter', 'default'))}]")
    return peers


def llamacpp_contender(target, binary: Path, gguf: Path, label: str = "llamacpp", **flags: Any) -> Contender:
    """llama.cpp's ``llama-server`` on the target's GGUF file, fed the same prompt token ids
    (:mod:`specwise.lab.bench.llamacpp`; ``flags`` become server flags; ``draft`` may name a
    target alias, whose assembled GGUF file it then is)."""
    if str(flags.get("draft")) in KNOWN_TARGETS:
        flags = {**flags, "draft": gguf_file(str(flags["draft"]))}
    server = LlamaServer(binary, gguf, flags, torch.get_num_threads())

    def run(prompt_ids, max_new_tokens, temperature=0.0, seed=None, ignore_eos=False, response_format=None,
            cache_prompt=False, **_sampling):
        reply = server.complete(prompt_ids.tolist(), max_new_tokens, temperature, seed, ignore_eos=ignore_eos,
                                json_schema=json_schema_of(response_format), cache_prompt=cache_prompt)
        timings = reply.get("timings", {})
        prefill_s, decode_s = timings.get("prompt_ms", 0.0) / 1e3, timings.get("predicted_ms", 0.0) / 1e3
        return Outcome(list(reply.get("tokens", [])), prefill_s + decode_s, None, decode_time_s=decode_s)

    # a restarted server (on its next request) holds no n-gram pool (ngram-mod's is shared across requests)
    return Contender(label, run, is_peer=True, describe=server.describe, caches_prompts=True, forget=server.close)


def json_schema_of(response_format: dict | None) -> dict | None:
    """The JSON schema llama-server's ``json_schema`` field takes for a ``response_format``.

    Raises:
        ConfigError: a format other than a JSON schema or object (the race sends llama-server only those).
    """
    if response_format is None:
        return None
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    if response_format.get("type") == "json_schema":
        return dict(response_format["json_schema"].get("schema", {"type": "object"}))
    raise ConfigError("llama-server races take a JSON schema or object as the response format.")


def parse_contender(target, spec: str, llama_server: Path | None = None, gguf: Path | None = None,
                    targets: dict | None = None) -> Contender:
    """Build a contender from ``name[key=value,...]``: a specwise method (``pld[num_draft_tokens=5]``),
    an HF peer (``hf-generate``, ``hf-pld[prompt_lookup_num_tokens=10]``), or llama.cpp
    (``llamacpp``, ``llamacpp[spec-type=ngram-map-k]``, given ``llama_server`` and the ``gguf`` file).
    A specwise method suffixed ``@WEIGHTS`` (``ar@bf16``) or ``@ENGINE`` (``pld@llamacpp``) runs on
    ``targets[suffix]`` instead.

    Raises:
        ConfigError: malformed spec, or llamacpp without a server or GGUF file. DrafterError:
            unknown method.
    """
    name, options = split_spec(spec)
    if name.startswith("hf-"):
        return hf_contender(target, name[3:], label=spec, **options)
    if name == "llamacpp":
        if llama_server is None or gguf is None:
            raise ConfigError("llamacpp contenders need --llama-server PATH (scripts/build-llama-server.sh builds one) "
                              "and a GGUF target.")
        return llamacpp_contender(target, llama_server, gguf, label=spec, **options)
    method, _, weights = name.partition("@")
    if weights:
        if not targets or weights not in targets:
            raise ConfigError(f"{spec}: no target with weights or engine {weights!r} is loaded for this run.")
        target = targets[weights]
    return specwise_contender(target, method, label=spec, **options)
