"""Target features for drafter training: the target's own predictions (and hidden states) per position.

One pass of the frozen target over a corpus (:mod:`specwise.training.corpus`) labels every position
with the target's top-k next-token log-probabilities and, where a recipe asks, the hidden states of
chosen layers. Distributions are taken over the **draft vocabulary** (the frequency-ranked subset of
the target's vocabulary a drafter predicts, FR-Spec / EAGLE-3 style, docs/algorithms.md §9): the target's
LM head restricted to those rows costs a fraction of the full 262k-row head, and a drafter can only
ever propose tokens of its own vocabulary anyway. Log-probabilities are normalized over that
vocabulary.

Features are stored next to the corpus shards they label (``features-NNNNN.safetensors`` for
``shard-NNNNN``), flat over the shard's tokens; an interrupted pass resumes at the first missing
shard.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specwise.errors import ConfigError
from specwise.training.corpus import SHARD_GLOB, iter_corpus, read_shard


def token_frequencies(corpus_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in a corpus. Returns ``[vocab_size]`` int64 counts."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in iter_corpus(corpus_dir):
        counts += torch.bincount(seq.tokens, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids (FR-Spec), most frequent first, ``always`` included.

    Args:
        counts: ``[V]`` int64 token counts (:func:`token_frequencies`).
        size: draft vocabulary size, ``len(always) <= size <= V``.
        always: ids kept whatever their count (e.g. EOS, so a drafter can propose the end).

    Returns:
        ``[size]`` int64 target token ids.

    Raises:
        ConfigError: a size out of range.
    """
    if not len(always) <= size <= counts.numel():
        raise ConfigError(f"draft vocabulary size must be in [{len(always)}, {counts.numel()}], got {size}.")
    boosted = counts.clone().double()
    boosted[list(always)] = float("inf")
    order = torch.argsort(boosted, descending=True, stable=True)
    return order[:size].clone()


def vocabulary_coverage(counts: torch.Tensor, vocab: torch.Tensor) -> float:
    """Share of corpus tokens that lie in ``vocab`` (an upper bound on a drafter's top-1 agreement)."""
    return float(counts[vocab].sum()) / max(float(counts.sum()), 1.0)


@dataclass(frozen=True)
class FeatureConfig:
    """What the features pass stores per position."""

    top_k: int = 8  # target log-probs kept per position (over the draft vocabulary)
    hidden_layers: tuple[int, ...] = ()  # HF hidden_states indices to store (bf16)
    batch_tokens: int = 8192  # tokens per target forward (padded batch)
    max_length: int = 2048  # longer sequences are cut


@torch.inference_mode()
def extract_features(
    target,
    corpus_dir: str | Path,
    vocab: torch.Tensor,
    config: FeatureConfig = FeatureConfig(),
    *,
    progress: Callable[[str], None] | None = None,
    features_dir: str | Path | None = None,
) -> Path:
    """Label every corpus position with the target's top-k over ``vocab`` (and hidden states).

    For a sequence of length T, position t holds the target's distribution of token t+1 given tokens
    ``0..t`` (the last position's label is the target's prediction past the end).

    Args:
        target: the frozen :class:`specwise.targets.hf.Target`.
        corpus_dir: a corpus directory; features are written beside its shards.
        vocab: ``[Vd]`` int64 draft vocabulary (target ids).
        config: :class:`FeatureConfig`.
        progress: ``callable(str)`` for progress lines.
        features_dir: where the features go (default: beside the shards). Recipes that need other
            features than an earlier run (e.g. hidden states) use their own directory.

    Returns:
        the features directory.

    Raises:
        ConfigError: the corpus already has features made with another vocabulary or layers.
    """
    corpus = Path(corpus_dir)
    where = Path(features_dir) if features_dir is not None else corpus
    where.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda message: None)
    _claim(where, vocab, config)
    model = target.model.get_decoder()
    head = target.model.get_output_embeddings().weight[vocab.to(target.device)]  # shape: [Vd, H]
    shards = sorted(corpus.glob(SHARD_GLOB))
    started, done_tokens = time.perf_counter(), 0
    for number, shard in enumerate(shards):
        out_path = where / shard.name.replace("shard-", "features-")
        if out_path.exists():
            continue
        tensors, tokens = _label_shard(target, model, head, vocab, read_shard(shard), config)
        done_tokens += tokens
        tmp = out_path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.rename(out_path)
        elapsed = time.perf_counter() - started
        rate = done_tokens / max(elapsed, 1e-9)
        say(f"features {number + 1}/{len(shards)}  {done_tokens} tokens  {rate:.0f} tok/s  elapsed {elapsed / 60:.1f} min")
    return where


def _claim(where: Path, vocab: torch.Tensor, config: FeatureConfig) -> None:
    """Record the features' settings and vocabulary in ``where``, or check those already there.

    Raises:
        ConfigError: ``where`` holds features made with another vocabulary or settings.
    """
    meta = {"top_k": config.top_k, "hidden_layers": list(config.hidden_layers), "vocab_size": int(vocab.numel())}
    meta_path = where / "features.json"
    vocab_path = where / "draft_vocab.safetensors"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        old_vocab = load_file(str(vocab_path))["vocab"] if vocab_path.exists() else None
        if old != meta or old_vocab is None or not torch.equal(old_vocab, vocab.cpu()):
            raise ConfigError(f"{where} already has features with other settings ({old}); delete features-* to redo them.")
    save_file({"vocab": vocab.cpu().contiguous()}, str(vocab_path))
    meta_path.write_text(json.dumps(meta))


def _label_shard(target, model, head: torch.Tensor, vocab: torch.Tensor, seqs: list,
                 config: FeatureConfig) -> tuple[dict[str, torch.Tensor], int]:
    """The features of one shard's sequences, flat over their tokens, and the padded tokens run.

    ``model`` is the target's decoder and ``head`` ``[Vd, H]`` its LM head's draft-vocabulary rows.
    """
    total = sum(s.tokens.numel() for s in seqs)
    top_ids = torch.zeros((total, config.top_k), dtype=torch.int32)
    top_logprobs = torch.zeros((total, config.top_k), dtype=torch.bfloat16)
    hidden = {i: torch.zeros((total, model.config.hidden_size), dtype=torch.bfloat16) for i in config.hidden_layers}
    offsets = torch.tensor([0] + [s.tokens.numel() for s in seqs]).cumsum(0).tolist()
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].tokens.numel())
    done_tokens = 0
    for group in _length_groups(order, seqs, config):
        width = min(max(seqs[i].tokens.numel() for i in group), config.max_length)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        for row, i in enumerate(group):
            n = min(seqs[i].tokens.numel(), width)
            ids[row, :n] = seqs[i].tokens[:n]
        out = model(input_ids=ids.to(target.device), use_cache=False,
                    output_hidden_states=bool(config.hidden_layers))
        for row, i in enumerate(group):
            n = min(seqs[i].tokens.numel(), width)
            start = offsets[i]
            logits = out.last_hidden_state[row, :n] @ head.T  # shape: [n, Vd]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            values, index = logprobs.topk(config.top_k, dim=-1)
            top_ids[start: start + n] = vocab[index.cpu()].to(torch.int32)
            top_logprobs[start: start + n] = values.cpu().to(torch.bfloat16)
            for layer in config.hidden_layers:
                hidden[layer][start: start + n] = out.hidden_states[layer][row, :n].cpu().to(torch.bfloat16)
        done_tokens += int(ids.numel())
    tensors = {"top_ids": top_ids, "top_logprobs": top_logprobs, **{f"hidden_{i}": h for i, h in hidden.items()}}
    return tensors, done_tokens


def _length_groups(order: list[int], seqs, config: FeatureConfig):
    group: list[int] = []
    for i in order:
        width = min(seqs[i].tokens.numel(), config.max_length)
        if group and width * (len(group) + 1) > config.batch_tokens:
            yield group
            group = []
        group.append(i)
    if group:
        yield group


def read_features(features_dir: str | Path, shard_name: str) -> dict[str, torch.Tensor]:
    """The features of one corpus shard (``shard-NNNNN.safetensors``), flat over its tokens.

    Args:
        features_dir: the directory :func:`extract_features` wrote to (the corpus, by default).

    Raises:
        ConfigError: the shard has no features yet.
    """
    path = Path(features_dir) / shard_name.replace("shard-", "features-")
    if not path.exists():
        raise ConfigError(f"{path} is missing; run the features pass (specwise train does it first).")
    with safe_open(str(path), framework="pt") as fh:
        return {key: fh.get_tensor(key) for key in fh.keys()}


@dataclass(frozen=True)
class LabelledSequence:
    """One corpus sequence with its target features, as recipes read them.

    Attributes:
        id: the prompt id (validation splits hash it).
        mode: ``"greedy"``, ``"sampled"`` or ``"text"`` (how the continuation was written).
        prompt_length: tokens before the target-written part.
        tokens: ``[T]`` long.
        top_index: ``[T, k]`` long, draft-vocabulary indices of the target's top-k at each position.
        top_probs: ``[T, k]`` float32, the target's top-k probabilities renormalized over them.
        hidden: ``[T, F*H]`` bf16, the requested hidden states concatenated in the order asked
            (``None`` when none were asked for).
    """

    id: str
    mode: str
    prompt_length: int
    tokens: torch.Tensor
    top_index: torch.Tensor
    top_probs: torch.Tensor
    hidden: torch.Tensor | None = None


def iter_labelled(corpus_dir: str | Path, vocab: torch.Tensor, hidden_layers: tuple[int, ...] = (),
                  features_dir: str | Path | None = None):
    """Every corpus sequence with its features (:class:`LabelledSequence`), shard by shard.

    Args:
        corpus_dir: a corpus with features.
        vocab: ``[Vd]`` int64 draft vocabulary the features were made with.
        hidden_layers: hidden-state indices to return concatenated (they must have been extracted).
        features_dir: where the features are (default: the corpus directory).

    Raises:
        ConfigError: no shards, missing features or hidden states, or ids outside ``vocab``.
    """
    corpus = Path(corpus_dir)
    shards = sorted(corpus.glob(SHARD_GLOB))
    if not shards:
        raise ConfigError(f"{corpus} holds no corpus shards.")
    index_of = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long)
    index_of[vocab] = torch.arange(vocab.numel())
    for shard in shards:
        features = read_features(features_dir if features_dir is not None else corpus, shard.name)
        missing = [i for i in hidden_layers if f"hidden_{i}" not in features]
        if missing:
            raise ConfigError(f"{shard.name} has no hidden states of layer {missing[0]}; extract features with "
                              f"hidden_layers={list(hidden_layers)} into their own features_dir.")
        hidden = torch.cat([features[f"hidden_{i}"] for i in hidden_layers], dim=-1) if hidden_layers else None
        offset = 0
        for seq in read_shard(shard):
            n = seq.tokens.numel()
            top_ids = features["top_ids"][offset: offset + n].long()
            top_index = index_of[top_ids.clamp_max(index_of.numel() - 1)]
            if bool((top_index < 0).any()):
                raise ConfigError(f"features of {shard.name} use ids outside the draft vocabulary.")
            probs = torch.softmax(features["top_logprobs"][offset: offset + n].float(), dim=-1)
            part = None if hidden is None else hidden[offset: offset + n]
            offset += n
            yield LabelledSequence(seq.id, seq.mode, seq.prompt_length, seq.tokens, top_index, probs, part)
