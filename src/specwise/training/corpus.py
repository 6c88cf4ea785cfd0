"""Self-distillation corpus: the target continues training prompts, and the texts are kept on disk.

Drafters learn the target's own distribution, so their training text should be the target's own
output (Medusa-2 and EAGLE both regenerate their data with the target for this reason). Batched
generation is what a CPU can afford (its throughput on the reference machine is in
docs/notes/train.md), so the corpus mixes two kinds of sequence:

* **continued** prompts: the prompt plus ``new_tokens`` tokens the target wrote (greedy or sampled,
  mixed batch by batch);
* **text-only** prompts: the prompt alone. They cost nothing here; :mod:`specwise.training.features`
  labels every position of both kinds with the target's own predictions.

The corpus is a directory of shards (``shard-NNNNN.safetensors``: flat ``tokens`` int32, per-sequence
``lengths`` and ``prompt_lengths``; the prompt ids and decoding mode in the metadata). Building it
again with the same arguments resumes: prompts already in a shard are skipped.

Prompts whose id falls in the evaluation split (:func:`specwise.prompts.is_held_out`) are never
used, so benchmarks on held-out prompts measure generalization.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LogitsProcessor, LogitsProcessorList

from specwise.errors import ConfigError
from specwise.prompts import PromptRecord, is_held_out
from specwise.targets.chat import has_chat_template

SHARD_GLOB = "shard-*.safetensors"


@dataclass(frozen=True)
class CorpusConfig:
    """How a corpus is built."""

    new_tokens: int = 192  # tokens the target writes after each continued prompt
    batch_size: int = 16  # prompts generated together (left-padded)
    sampled_fraction: float = 0.5  # share of generation batches that sample instead of greedy
    temperature: float = 0.7  # temperature of the sampled batches
    max_prompt_tokens: int = 1024  # longer prompts are skipped
    continued_prompts: int | None = None  # how many prompts get continuations (None: all)
    text_only_prompts: int = 0  # further prompts kept as text only (labelled later)
    seed: int = 0  # shuffling and sampling seed
    chat: bool = False  # each prompt as one user message through the target's chat template

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.batch_size < 1 or self.max_prompt_tokens < 1:
            raise ConfigError("new_tokens, batch_size and max_prompt_tokens must be >= 1.")
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ConfigError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction}.")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature}.")
        if self.text_only_prompts < 0 or (self.continued_prompts is not None and self.continued_prompts < 0):
            raise ConfigError("prompt counts must be >= 0.")


@dataclass(frozen=True)
class Sequence:
    """One corpus sequence: ``tokens`` ``[T]`` long (BOS + prompt + continuation), of which the first
    ``prompt_length`` are the prompt; ``id`` is the prompt's id, ``mode`` is greedy / sampled / text."""

    id: str
    tokens: torch.Tensor
    prompt_length: int
    mode: str


def interleave_categories(records: list[PromptRecord], seed: int) -> list[PromptRecord]:
    """Shuffle each category with ``seed`` and deal them round-robin, so any prefix is balanced."""
    by_category: dict[str, list[PromptRecord]] = {}
    for record in records:
        by_category.setdefault(record.category, []).append(record)
    rng = random.Random(seed)
    queues = []
    for category in sorted(by_category):
        items = list(by_category[category])
        rng.shuffle(items)
        queues.append(items)
    dealt = []
    while any(queues):
        for queue in queues:
            if queue:
                dealt.append(queue.pop(0))
    return dealt


def build_corpus(
    target,
    records: list[PromptRecord],
    out_dir: str | Path,
    config: CorpusConfig = CorpusConfig(),
    *,
    minutes: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Build (or resume) a self-distillation corpus.

    Args:
        target: a :class:`specwise.targets.hf.Target` (bf16 recommended; generation uses HF ``generate``).
        records: training prompts; held-out ones are dropped here.
        out_dir: the corpus directory (created; existing shards are kept and their prompts skipped).
        config: :class:`CorpusConfig`.
        minutes: stop generating after about this many minutes (the corpus stays usable and a
            later call resumes); ``None`` runs to the end.
        progress: ``callable(str)`` for progress lines with throughput and ETA.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ConfigError: no usable training prompts, or ``config.chat`` for a target without a chat
            template (refused before anything is written).
    """
    if config.chat and not has_chat_template(target.tokenizer):
        raise ConfigError(f"target {target.name} has no chat template: build its corpus without --chat.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda message: None)
    _record_build(out, target, config, minutes)
    done = {seq_id for seq_id in _shard_ids(out)}
    text_only, continued = _split_prompts(records, config)
    shard_index = len(list(out.glob(SHARD_GLOB)))
    todo_text = [r for r in text_only if r.id not in done]
    if todo_text:
        seqs = []
        for record in todo_text:
            ids = _prompt_ids(target, record, config)
            if ids.numel() <= config.max_prompt_tokens:
                seqs.append(Sequence(record.id, ids, ids.numel(), "text"))
        _write_shard(out / f"shard-{shard_index:05d}.safetensors", seqs)
        shard_index += 1
        say(f"text-only: {len(seqs)} prompts stored")
    batches = _prompt_batches(target, [r for r in continued if r.id not in done], config)
    _generate_batches(target, batches, out, shard_index, config, minutes, say)
    return out


def _record_build(out: Path, target, config: CorpusConfig, minutes: float | None) -> None:
    """Append this build's settings to ``corpus.json`` (every build and resume of a corpus, in order)."""
    record_path = out / "corpus.json"
    history = json.loads(record_path.read_text()) if record_path.exists() else {"target": target.name, "builds": []}
    history.setdefault("builds", []).append({**asdict(config), "minutes": minutes})
    record_path.write_text(json.dumps(history, indent=1))


def _split_prompts(records: list[PromptRecord], config: CorpusConfig) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """``(text-only, continued)`` training prompts, held-out ones removed.

    Raises:
        ConfigError: no prompts left after removing the held-out split.
    """
    usable = [r for r in interleave_categories(records, config.seed) if not is_held_out(r)]
    if not usable:
        raise ConfigError("no training prompts left after removing the held-out split.")
    # text-only prompts come from the end of the dealt order, continued ones from the start
    n_text = min(config.text_only_prompts, len(usable))
    text_only = usable[len(usable) - n_text:]
    continued = usable[: len(usable) - n_text]
    if config.continued_prompts is not None:
        continued = continued[: config.continued_prompts]
    return text_only, continued


def _prompt_ids(target, record: PromptRecord, config: CorpusConfig) -> torch.Tensor:
    """``[T]`` long ids of a prompt: the raw text, or with ``config.chat`` one user message through
    the target's chat template with the assistant's turn opened (what a chat user sends; the
    continuation is then the assistant's reply and ends at the end-of-turn token).

    Raises:
        PromptError: the chat template refused the message.
    """
    if config.chat:
        return target.encode_chat([{"role": "user", "content": record.prompt}]).cpu()
    return target.encode(record.prompt).cpu()


def _prompt_batches(target, todo: list[PromptRecord], config: CorpusConfig) -> list[list]:
    """Generation batches of ``(record, prompt ids)``, prompts over ``max_prompt_tokens`` skipped."""
    encoded = []
    for record in todo:
        ids = _prompt_ids(target, record, config)
        if ids.numel() <= config.max_prompt_tokens:
            encoded.append((record, ids))
    # batches of similar prompt length waste less padding; batches are taken in dealt order of
    # windows of 8 batches, so categories stay mixed over time
    batches = []
    window = 8 * config.batch_size
    for start in range(0, len(encoded), window):
        chunk = sorted(encoded[start: start + window], key=lambda item: item[1].numel())
        batches += [chunk[i: i + config.batch_size] for i in range(0, len(chunk), config.batch_size)]
    return batches


def _generate_batches(target, batches: list[list], out: Path, shard_index: int, config: CorpusConfig,
                      minutes: float | None, say: Callable[[str], None]) -> None:
    """Continue each batch (greedy, or sampled for ``sampled_fraction`` of them) into its own shard,
    from ``shard-<shard_index>`` on, stopping after about ``minutes``."""
    rng = random.Random(config.seed + shard_index)
    started = time.perf_counter()
    generated = 0
    for number, batch in enumerate(batches):
        sampled = rng.random() < config.sampled_fraction
        seqs = _generate_batch(target, batch, config, sampled, seed=config.seed + shard_index)
        _write_shard(out / f"shard-{shard_index:05d}.safetensors", seqs)
        shard_index += 1
        generated += sum(s.tokens.numel() - s.prompt_length for s in seqs)
        elapsed = time.perf_counter() - started
        rate = generated / max(elapsed, 1e-9)
        eta = elapsed / (number + 1) * (len(batches) - number - 1)
        say(f"batch {number + 1}/{len(batches)}  {generated} new tokens  {rate:.0f} tok/s  "
            f"elapsed {elapsed / 60:.1f} min  eta {eta / 60:.1f} min")
        if minutes is not None and elapsed > minutes * 60:
            say(f"stopping after {elapsed / 60:.1f} min (--minutes); run again to resume")
            break


@torch.inference_mode()
def _generate_batch(target, batch, config: CorpusConfig, sampled: bool, seed: int) -> list[Sequence]:
    pad = target.tokenizer.pad_token_id
    pad = 0 if pad is None else int(pad)
    width = max(ids.numel() for _, ids in batch)
    input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (_, ids) in enumerate(batch):  # left padding: every prompt ends at the same column
        input_ids[row, width - ids.numel():] = ids
        attention[row, width - ids.numel():] = 1
    options = {}
    if sampled:
        generator = torch.Generator(device=target.device).manual_seed(seed)
        options["logits_processor"] = LogitsProcessorList([GumbelMaxSampler(config.temperature, generator)])
    out = target.model.generate(
        input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
        max_new_tokens=config.new_tokens, pad_token_id=pad, do_sample=False, **options,
        # an index tensor, not the int 1 generate would pass: see Target.forward (slow linear path)
        logits_to_keep=torch.tensor([-1], device=target.device),
    ).cpu()
    seqs = []
    eos = target.eos_token_ids
    for row, (record, ids) in enumerate(batch):
        continuation = out[row, width:].tolist()
        for i, token in enumerate(continuation):
            if token in eos:
                continuation = continuation[: i + 1]
                break
        tokens = torch.cat([ids, torch.tensor(continuation, dtype=torch.long)])
        seqs.append(Sequence(record.id, tokens, ids.numel(), "sampled" if sampled else "greedy"))
    return seqs


class GumbelMaxSampler(LogitsProcessor):
    """Temperature sampling through greedy search: ``argmax(scores / T + Gumbel noise)`` is an exact
    draw from ``softmax(scores / T)`` (the Gumbel-max trick). It keeps sampled batches on HF's
    greedy path, which is much faster than HF's own sampling path (top-p sorts the whole
    vocabulary every step); the timing is in docs/notes/train.md."""

    def __init__(self, temperature: float, generator: torch.Generator) -> None:
        self.temperature = temperature
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # shape: scores [B, V] float
        uniform = torch.rand(scores.shape, generator=self.generator, device=scores.device)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
        return scores.float() / self.temperature + gumbel


def _write_shard(path: Path, seqs: list[Sequence]) -> None:
    if not seqs:
        return
    tensors = {
        "tokens": torch.cat([s.tokens for s in seqs]).to(torch.int32),
        "lengths": torch.tensor([s.tokens.numel() for s in seqs], dtype=torch.int64),
        "prompt_lengths": torch.tensor([s.prompt_length for s in seqs], dtype=torch.int64),
    }
    meta = {"ids": json.dumps([s.id for s in seqs]), "modes": json.dumps([s.mode for s in seqs])}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.rename(path)  # a shard is either complete or absent


def read_shard(path: str | Path) -> list[Sequence]:
    """The sequences of one corpus shard."""
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
        tokens = fh.get_tensor("tokens").long()
        lengths = fh.get_tensor("lengths").tolist()
        prompt_lengths = fh.get_tensor("prompt_lengths").tolist()
    ids, modes = json.loads(meta["ids"]), json.loads(meta["modes"])
    seqs, offset = [], 0
    for seq_id, mode, length, prompt_length in zip(ids, modes, lengths, prompt_lengths):
        seqs.append(Sequence(seq_id, tokens[offset: offset + length], int(prompt_length), mode))
        offset += length
    return seqs


def iter_corpus(corpus_dir: str | Path) -> Iterator[Sequence]:
    """Every sequence of a corpus directory, shard by shard.

    Raises:
        ConfigError: the directory has no shards.
    """
    shards = sorted(Path(corpus_dir).glob(SHARD_GLOB))
    if not shards:
        raise ConfigError(f"{corpus_dir} holds no corpus shards; build one with `specwise data build`.")
    for shard in shards:
        yield from read_shard(shard)


def _shard_ids(out: Path) -> Iterator[str]:
    for shard in sorted(out.glob(SHARD_GLOB)):
        with safe_open(str(shard), framework="pt") as fh:
            yield from json.loads(fh.metadata()["ids"])
