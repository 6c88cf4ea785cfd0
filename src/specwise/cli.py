"""The ``specwise`` command line (ARCHITECTURE.md §3).

Bad input is reported as one sentence on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import transformers
from rich.console import Console

from specwise.api import check_seed, check_stop_strings, check_text, generate, spec_and_config
from specwise.drafters.checkpoint import shipped_drafter
from specwise.drafters.spec import parse_option_value, split_spec, split_specs
from specwise.engine.aliases import KNOWN_TARGETS
from specwise.engine.chat import check_messages
from specwise.engine.clock import machine_info
from specwise.engine.loading import alias_cache_state, gguf_file
from specwise.engine.native.weights import WEIGHTS, WEIGHTS_HELP
from specwise.engine.sampling import SamplingConfig
from specwise.engine.target import load_target, resolve_device
from specwise.errors import ConfigError, DrafterError, PromptError, SpecwiseError
from specwise.lab.analysis.cli import add_analyze_args, cmd_analyze
from specwise.lab.bench import parse_contender, run_benchmark
from specwise.lab.bench.contenders import hf_peer_specs
from specwise.lab.bench.plots import write_bench_plots
from specwise.lab.bench.progress import bench_progress
from specwise.lab.bench.report import markdown_report, rich_table
from specwise.lab.bench.sweep import Sweep
from specwise.lab.demo import run_demo
from specwise.lab.report import stats_table
from specwise.prompts import default_prompt_records, is_held_out, load_prompts, take_per_category
from specwise.serve.cli import add_serve_args, cmd_serve
from specwise.training.cli import add_data_args, add_drafter_export_args, add_export_args, add_train_args

DEFAULT_TARGET = "gemma-3-270m"


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (or --chat)")
    p.add_argument("--chat", default=None, metavar="TEXT",
                   help="a user message, sent through the target's chat template (instead of a raw prompt)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"alias ({', '.join(KNOWN_TARGETS)}), HF model directory or .gguf file")
    p.add_argument("--method", default="ar", help="drafting method: ar, pld, lookahead, draft, eagle, medusa, dflash (default ar)")
    p.add_argument("--drafter", default=None, help="trained drafter directory, or a draft model's alias or path (draft, eagle, medusa, dflash; default: the shipped one)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="draft tokens verified per step (K)")
    p.add_argument("--max-ngram-size", type=int, default=None, help="pld: longest n-gram to match")
    p.add_argument("--min-ngram-size", type=int, default=None, help="pld: shortest n-gram to match")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="any method option, e.g. --option window_size=3 for lookahead (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "float64"])
    p.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def method_options(args: argparse.Namespace) -> dict:
    """The method options given on the command line (only those the user set).

    Raises:
        ConfigError: an ``--option`` that is not ``KEY=VALUE``.
    """

    names = {"num_draft_tokens": args.num_draft_tokens, "drafter_path": args.drafter,
             "max_ngram_size": args.max_ngram_size, "min_ngram_size": args.min_ngram_size}
    options = {k: v for k, v in names.items() if v is not None}
    for item in args.option:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--option takes KEY=VALUE, got {item!r}.")
        options[key.strip()] = parse_option_value(value.strip())
    return options


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _chat_messages(args: argparse.Namespace) -> list[dict] | None:
    """The ``--chat`` / ``--system`` messages, or ``None`` for a raw prompt.

    Raises:
        PromptError: both or neither of a prompt and ``--chat``; ``--system`` without ``--chat``; an
            empty or invalid text.
    """
    if (args.prompt is None) == (args.chat is None):
        raise PromptError("give a prompt or --chat TEXT, not both." if args.chat is not None
                          else "give a prompt (or --chat TEXT).")
    if args.chat is None:
        if args.system is not None:
            raise PromptError("--system needs --chat.")
        check_text("the prompt", args.prompt)
        if not args.prompt.strip():
            raise PromptError("the prompt is empty.")
        return None
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages.append({"role": "user", "content": args.chat})
    for message in messages:
        check_text(f"the {message['role']} message", message["content"])
    return check_messages(messages)


def cmd_generate(args: argparse.Namespace) -> int:
    messages = _chat_messages(args)
    # validate cheap options before the (slower) model load
    SamplingConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    check_seed(args.seed)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    check_stop_strings(args.stop)
    options = method_options(args)
    spec, config = spec_and_config(args.method, **options)
    if spec.needs_weights:  # a trained drafter: fail before the (slower) target load
        if config.drafter_path is None and shipped_drafter(args.target, args.method) is None:
            what = "a draft model" if args.method == "draft" else "a trained drafter"
            raise DrafterError(f"method {args.method!r} needs {what} for {args.target}: pass --drafter PATH "
                               "(trained drafters ship for gemma-3-270m; a draft model for qwen2.5-coder-1.5b-instruct).")
        if (config.drafter_path is not None and config.drafter_path not in KNOWN_TARGETS
                and not Path(config.drafter_path).exists()):
            aliases = (f" (and is not one of the draft-model aliases {', '.join(KNOWN_TARGETS)})"
                       if args.method == "draft" else "")
            raise DrafterError(f"the drafter {config.drafter_path} does not exist{aliases}.")
    resolve_device(args.device)
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_progress, weights=args.weights)
    streamer = None if args.json else _TextStreamer()
    result = generate(
        target, args.prompt, messages=messages, method=args.method, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        text_streamer=streamer, **options,
    )
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                          "stop_string": result.stop_string, "stats": result.stats.to_dict()}))
    else:
        print()
        Console(stderr=False).print(stats_table([result.stats]))
    return 0


class _TextStreamer:
    """Prints the text pieces :func:`generate` streams: decoded incrementally, an incomplete
    character or a possible stop string's beginning held back until it settles, all of it flushed
    at the end."""

    def __call__(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()


def cmd_targets(args: argparse.Namespace) -> int:
    width = max(map(len, KNOWN_TARGETS))
    for known in KNOWN_TARGETS.values():
        installed = "installed" if known.installed() else f"not installed (pip install {known.install})"
        print(f"{known.alias:<{width}}  {known.size / 2**20:>6,.0f} MiB  {installed}; cache: {alias_cache_state(known)}")
        print(f"{'':<{width}}  {known.description}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(target_name=args.target, max_new_tokens=args.max_new_tokens, device=args.device,
                    progress=_progress)


def cmd_bench(args: argparse.Namespace) -> int:
    records = _bench_prompts(args)
    specs = split_specs(args.methods)
    if args.hf_peers:
        specs += hf_peer_specs(specs)
    sweep = None
    if args.sweep:  # one contender per value, all measured side by side in the same run
        specs, sweep = Sweep.parse(args.sweep).expand(specs)
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_progress, weights=args.weights)
    others = {w: load_target(args.target, dtype=args.dtype, device=args.device, weights=w)
              for w in sorted({split_spec(s)[0].partition("@")[2] for s in specs} - {""})}
    server = Path(args.llama_server) if args.llama_server else None
    gguf = gguf_file(args.target) if server else None
    contenders = [parse_contender(target, spec, server, gguf, others) for spec in specs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    extra = {"command": " ".join(["specwise", *sys.argv[1:]]), "machine": machine_info(target.device)}
    if sweep:
        extra["sweep"] = sweep.to_config()
    with bench_progress(console, len(records) * len(contenders)) as on_progress:
        result = run_benchmark(target, records, contenders, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, on_progress=on_progress,
                               extra_config=extra, chat=args.chat)
    results = result.to_dict()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plots = write_bench_plots(results, out)
    (out / "report.md").write_text(markdown_report(result, plots))
    for group in result.summaries if console.is_terminal else ["overall"]:  # a log gets the overall table
        console.print(rich_table(result, group))
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {', '.join(p.name for p in plots)}")
    return 0


def _bench_prompts(args: argparse.Namespace) -> list:
    """The prompt records a ``bench`` run measures.

    Raises:
        ConfigError: the selection leaves no prompt.
    """
    records = load_prompts(args.prompts) if args.prompts else default_prompt_records()
    if args.held_out:
        records = [r for r in records if is_held_out(r)]
    if args.per_category:
        records = take_per_category(records, args.per_category)
    if not records:
        raise ConfigError("no prompts to benchmark.")
    return records


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specwise", description="Lossless speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with one method")
    _add_generate_args(gen)
    gen.set_defaults(func=cmd_generate)
    sub.add_parser("targets", help="list the target aliases: installed or not, size, cache state"
                   ).set_defaults(func=cmd_targets)
    demo = sub.add_parser("demo", help="run ar, pld, lookahead, draft, eagle, medusa and dflash on the default target with a few "
                               "built-in prompts, side by side")
    demo.add_argument("--target", default=DEFAULT_TARGET)
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--device", default=None)
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="benchmark methods and Hugging Face peers, interleaved in one process")
    bench.add_argument("--target", default=DEFAULT_TARGET)
    bench.add_argument("--prompts", nargs="*", default=None, help="prompt JSONL files (default: the built-in set + 3 HumanEval prompts)")
    bench.add_argument("--methods", default="ar,pld,lookahead",
                       help="comma-separated contenders, e.g. 'ar,pld,pld[num_draft_tokens=5,max_ngram_size=2],hf-pld'")
    bench.add_argument("--hf-peers", action="store_true", help="add Hugging Face generate and prompt lookup")
    bench.add_argument("--per-category", type=int, default=0, help="first N prompts of each category")
    bench.add_argument("--held-out", action="store_true",
                       help="only prompts of the evaluation split, which drafter training never uses")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--chat", action="store_true", help="send each prompt as a user message through the target's chat template")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "float64"])
    bench.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    bench.add_argument("--device", default=None)
    bench.add_argument("--out", default="runs/bench")
    bench.add_argument("--llama-server", default=None, metavar="PATH",
                       help="llama.cpp's llama-server, for the llamacpp[...] contenders (scripts/build-llama-server.sh)")
    bench.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                       help="run every drafting method once per value of one option, e.g. num_draft_tokens=1,3,5,7")
    bench.set_defaults(func=cmd_bench)
    analyze = sub.add_parser("analyze", help="speedup model: calibrate costs on this machine, plot, check against a bench run")
    add_analyze_args(analyze, default_target=DEFAULT_TARGET)
    analyze.set_defaults(func=cmd_analyze)
    add_data_args(sub.add_parser("data", help="build training corpora for drafters"), DEFAULT_TARGET)
    add_train_args(sub.add_parser("train", help="train a drafter for a target (self-distillation)"), DEFAULT_TARGET)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat, streaming, Predicted Outputs)")
    add_serve_args(serve, DEFAULT_TARGET)
    serve.set_defaults(func=cmd_serve)
    add_drafter_export_args(sub.add_parser("export", help="write a trained drafter for vLLM, SGLang or llama.cpp"),
                            DEFAULT_TARGET)
    add_export_args(sub.add_parser("export-hf", help="write a draft LM as a plain Hugging Face causal LM"),
                    DEFAULT_TARGET)
    return parser


def _quiet_transformers() -> None:
    """The CLI prints its own progress: silence transformers' load bars and advisory warnings."""

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_transformers()
    try:
        return args.func(args)
    except SpecwiseError as exc:
        print(f"specwise: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
