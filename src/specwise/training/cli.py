"""``specwise data build``, ``specwise train`` and ``specwise export-hf``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specwise.drafters.checkpoint import read_config, shipped_drafter
from specwise.drafters.draft_model import load_draft_lm
from specwise.engine.target import load_target, resolve_dtype
from specwise.errors import ConfigError, DrafterError
from specwise.models.export import export_hf
from specwise.prompts import load_prompts
from specwise.training.corpus import SHARD_GLOB, CorpusConfig, build_corpus
from specwise.training.precision import keep_freed_memory
from specwise.training.recipes import RECIPES


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _expand(paths: list[str]) -> list[Path]:

    out = []
    for item in paths:
        path = Path(item)
        out += sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not out:
        raise ConfigError("no prompt files given (--data FILE... or a directory of .jsonl files).")
    return out


def add_data_args(p: argparse.ArgumentParser, default_target: str) -> None:
    sub = p.add_subparsers(dest="data_command", required=True)
    build = sub.add_parser("build", help="self-distillation corpus: the target continues training prompts")
    build.add_argument("--target", default=default_target)
    build.add_argument("--data", nargs="+", required=True, help="prompt JSONL files or directories")
    build.add_argument("--out", required=True, help="corpus directory (resumes when it exists)")
    build.add_argument("--minutes", type=float, default=None, help="stop generating after about M minutes")
    build.add_argument("--new-tokens", type=int, default=192)
    build.add_argument("--batch-size", type=int, default=16)
    build.add_argument("--sampled-fraction", type=float, default=0.5)
    build.add_argument("--temperature", type=float, default=0.7)
    build.add_argument("--continued-prompts", type=int, default=None, help="prompts to continue (default all)")
    build.add_argument("--text-only-prompts", type=int, default=0, help="further prompts kept as text only")
    build.add_argument("--max-prompt-tokens", type=int, default=1024)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--dtype", default="bfloat16")
    build.add_argument("--device", default=None)
    build.set_defaults(func=cmd_data_build)


def cmd_data_build(args: argparse.Namespace) -> int:

    config = CorpusConfig(
        new_tokens=args.new_tokens, batch_size=args.batch_size, sampled_fraction=args.sampled_fraction,
        temperature=args.temperature, max_prompt_tokens=args.max_prompt_tokens,
        continued_prompts=args.continued_prompts, text_only_prompts=args.text_only_prompts, seed=args.seed,
    )
    records = load_prompts(_expand(args.data))
    keep_freed_memory()
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_say)
    out = build_corpus(target, records, args.out, config, minutes=args.minutes, progress=_say)
    _say(f"corpus in {out}")
    return 0


def add_train_args(p: argparse.ArgumentParser, default_target: str) -> None:
    p.add_argument("method", help="drafter to train: draft, eagle, medusa or dflash")
    p.add_argument("--target", default=default_target)
    p.add_argument("--data", nargs="+", required=True,
                   help="a corpus directory (from `specwise data build`), or prompt JSONL files to build one from")
    p.add_argument("--out", required=True, help="output drafter directory (resumes when it holds a trainer state)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=None, help="training time budget (default 45)")
    budget.add_argument("--steps", type=int, default=None, help="optimizer steps instead of a time budget")
    p.add_argument("--corpus-minutes", type=float, default=10.0, help="generation budget when --data are prompt files")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--init-layers", default=None, help="draft: target layers its own layers start from, e.g. 0,-1")
    p.add_argument("--borrowed-layers", type=int, default=None,
                   help="draft: run the target's first N layers first (frozen, not stored)")
    p.add_argument("--feature-layers", default=None,
                   help="eagle, dflash: target hidden_states indices to fuse, e.g. 2,9,15 (default: low, middle, high)")
    p.add_argument("--ttt-steps", type=int, default=None, help="eagle: draft steps unrolled in training (default 3)")
    p.add_argument("--max-length", type=int, default=None, help="eagle, dflash: longest training window (default 1024)")
    p.add_argument("--loss-on", choices=("generated", "all"), default=None,
                   help="positions with a loss: every position ('all', the default) or those predicting tokens the "
                        "target wrote ('generated')")
    p.add_argument("--num-heads", type=int, default=None, help="medusa: heads trained (default 4)")
    p.add_argument("--medusa-layers", type=int, default=None, help="medusa: residual blocks per head (default 1)")
    p.add_argument("--block-size", type=int, default=None, help="dflash: tokens per block, anchor included (default 8)")
    p.add_argument("--dflash-layers", type=int, default=None, help="dflash: draft transformer layers (default 2)")
    p.add_argument("--top-k", type=int, default=8, help="target log-probs kept per position")
    p.add_argument("--validate-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from the weights of this trained drafter (same method, architecture and corpus "
                        "vocabulary); the optimizer and schedule start afresh")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="matmul precision of the drafter's training: bf16 autocast, fp32, or auto (whichever runs "
                        "a training-sized matmul faster here; fp32 on CPUs without fast bf16 units)")
    p.add_argument("--dtype", default="bfloat16", help="dtype the target runs in")
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:

    if args.method not in RECIPES:
        raise ConfigError(f"no training recipe for {args.method!r}; available: {', '.join(RECIPES)}.")
    if args.init_from:  # fail before any features pass; the weights are checked in full later

        found = read_config(args.init_from).get("method")
        if found != args.method:
            raise DrafterError(f"--init-from {args.init_from} holds a {found!r} drafter, not a {args.method!r} one.")
    keep_freed_memory()  # this process trains: reuse big freed blocks instead of page-faulting new ones
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_say)
    corpus = _corpus_from(args, target)
    out = RECIPES[args.method](target, corpus, Path(args.out), args, _say)
    _say(f"drafter written to {out}")
    return 0


def _corpus_from(args: argparse.Namespace, target) -> Path:

    corpora = [Path(p) for p in args.data if Path(p).is_dir() and any(Path(p).glob(SHARD_GLOB))]
    if len(corpora) > 1:
        raise ConfigError("give one corpus directory (merge prompt files into one `specwise data build` instead).")
    if corpora:
        return corpora[0]
    records = load_prompts(_expand(args.data))
    return build_corpus(target, records, Path(args.out) / "corpus", CorpusConfig(seed=args.seed),
                        minutes=args.corpus_minutes, progress=_say)


def add_export_args(p: argparse.ArgumentParser, default_target: str) -> None:
    p.add_argument("drafter", nargs="?", default=None, help="draft LM directory (default: the shipped one)")
    p.add_argument("--target", default=default_target)
    p.add_argument("--out", required=True, help="HF model directory to write")
    p.add_argument("--dtype", default="bfloat16")
    p.set_defaults(func=cmd_export_hf)


def cmd_export_hf(args: argparse.Namespace) -> int:

    target = load_target(args.target, dtype=args.dtype, device="cpu", progress=_say)
    path = args.drafter or shipped_drafter(target, "draft")
    if path is None:
        raise DrafterError(f"no draft LM ships for {target.name}; give its directory.")
    out = export_hf(load_draft_lm(path, target), target, args.out, resolve_dtype(args.dtype))
    _say(f"wrote a Hugging Face model to {out}")
    return 0
