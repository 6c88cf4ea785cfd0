"""``specwise bench``: methods, Hugging Face peers and llama.cpp raced on the same prompts in one run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console

from specwise.drafters.spec import split_spec, split_specs
from specwise.engine.clock import machine_info
from specwise.errors import ConfigError
from specwise.lab.bench.contenders import hf_peer_specs, parse_contender
from specwise.lab.bench.conversations import load_conversations, run_conversations, summarize_turns, turns_markdown
from specwise.lab.bench.plots import write_bench_plots
from specwise.lab.bench.progress import bench_progress
from specwise.lab.bench.report import markdown_report, rich_table
from specwise.lab.bench.runner import run_benchmark
from specwise.lab.bench.sweep import Sweep
from specwise.prompts import default_prompt_records, is_held_out, load_prompts, take_per_category
from specwise.targets.engine_choice import ENGINES
from specwise.targets.files import gguf_file
from specwise.targets.loading import load_target
from specwise.targets.native.weights import WEIGHTS, WEIGHTS_HELP


def add_bench_args(bench: argparse.ArgumentParser, default_target: str) -> None:
    """The flags of ``specwise bench``; sets ``func``."""
    bench.add_argument("--target", default=default_target)
    bench.add_argument("--prompts", nargs="*", default=None, help="prompt JSONL files (default: the built-in set + 3 HumanEval prompts)")
    bench.add_argument("--methods", default="ar,pld,lookahead",
                       help="comma-separated contenders, e.g. 'ar,pld,pld[num_draft_tokens=5,max_ngram_size=2],hf-pld'")
    bench.add_argument("--hf-peers", action="store_true", help="add Hugging Face generate and prompt lookup")
    bench.add_argument("--per-category", type=int, default=0, help="first N prompts of each category")
    bench.add_argument("--skip-per-category", type=int, default=0,
                       help="leave out the first N prompts of each category first (tune on prompts a race does not use)")
    bench.add_argument("--held-out", action="store_true",
                       help="only prompts of the evaluation split, which drafter training never uses")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--chat", action="store_true", help="send each prompt as a user message through the target's chat template")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="every contender generates --max-new-tokens tokens, past end-of-sequence (fixed-length timing)")
    bench.add_argument("--json-schema", default=None, metavar="FILE",
                       help="every contender constrains its output to the JSON schema in FILE (llama-server by its "
                            "own json_schema; METHOD[constrained=false] runs unconstrained beside them)")
    bench.add_argument("--instruction", default=None, metavar="TEXT",
                       help="appended to every prompt after a blank line (e.g. what JSON to answer in)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="run the race N times, each from the same start (drafting indexes and llama-server's "
                            "n-gram pool fresh), and time each contender on each prompt by its fastest run")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16", "float64"])
    bench.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    bench.add_argument("--engine", default="torch", choices=["auto", *ENGINES],
                       help="the engine our contenders run on (default torch; auto: the faster measured here); "
                            "METHOD@llamacpp or METHOD@torch runs one contender on the other, in the same run")
    bench.add_argument("--device", default=None)
    bench.add_argument("--out", default="runs/bench")
    bench.add_argument("--llama-server", default=None, metavar="PATH",
                       help="llama.cpp's llama-server, for the llamacpp[...] contenders (scripts/build-llama-server.sh)")
    bench.add_argument("--conversations", default=None, metavar="FILE",
                       help="multi-turn conversations (JSON Lines; benchmarks/agentic.py --export FILE builds one): "
                            "every contender through every turn, each turn's history the first contender's reply")
    bench.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                       help="run every drafting method once per value of one option, e.g. num_draft_tokens=1,3,5,7")
    bench.set_defaults(func=cmd_bench)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.conversations:
        return _bench_conversations(args)
    records = _bench_prompts(args)
    response_format = _response_format(args)
    specs = split_specs(args.methods)
    if args.hf_peers:
        specs += hf_peer_specs(specs)
    sweep = None
    if args.sweep:  # one contender per value, all measured side by side in the same run
        specs, sweep = Sweep.parse(args.sweep).expand(specs)
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_progress, weights=args.weights,
                         engine=args.engine)
    others = {w: _other_target(args, w) for w in sorted({split_spec(s)[0].partition("@")[2] for s in specs} - {""})}
    # the same cache state for every contender on every prompt: each pays its prompt's prefill, as the
    # llama-server peers do (cache_prompt false); a prompt reused from the contender before it would
    # tilt tok/s (prefill included) towards whoever runs second
    for engine_target in (target, *others.values()):
        if hasattr(engine_target, "prefix_reuse"):
            engine_target.prefix_reuse = False
    server = Path(args.llama_server) if args.llama_server else None
    gguf = gguf_file(args.target) if server else None
    contenders = [parse_contender(target, spec, server, gguf, others) for spec in specs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    extra = {"command": " ".join(["specwise", *sys.argv[1:]]), "machine": machine_info(target.device),
             "cache_state": "no prompt prefix reused across contenders or prompts (specwise's prefix reuse off, "
                            "llama-server's cache_prompt false): every contender pays every prompt's prefill"}
    if sweep:
        extra["sweep"] = sweep.to_config()
    with bench_progress(console, args.repeats * len(records) * len(contenders)) as on_progress:
        result = run_benchmark(target, records, contenders, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, seed=args.seed, on_progress=on_progress,
                               extra_config=extra, chat=args.chat, ignore_eos=args.ignore_eos,
                               response_format=response_format, repeats=args.repeats)
    results = result.to_dict()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plots = write_bench_plots(results, out)
    (out / "report.md").write_text(markdown_report(result, plots))
    for group in result.summaries if console.is_terminal else ["overall"]:  # a log gets the overall table
        console.print(rich_table(result, group))
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {', '.join(p.name for p in plots)}")
    return 0


def _bench_conversations(args: argparse.Namespace) -> int:
    """``--conversations``: each of our contenders on a target object of its own (its prefix store and
    drafter kept across turns, as a server keeps them), the peers as configured; rows written as
    they come (``turns.jsonl``), then ``summary.json`` and ``report.md``."""
    conversations = load_conversations(args.conversations)  # fail on a bad file before loading models
    if args.sweep or args.hf_peers or args.json_schema:
        raise ConfigError("--conversations takes its turns' formats from the file; drop --sweep, --hf-peers "
                          "and --json-schema.")
    specs = split_specs(args.methods)
    server = Path(args.llama_server) if args.llama_server else None
    gguf = gguf_file(args.target) if server else None
    load = lambda: load_target(args.target, dtype=args.dtype, device=args.device, weights=args.weights,  # noqa: E731
                               engine=args.engine)
    target = load()
    contenders = []
    for spec in specs:
        peer = split_spec(spec)[0].startswith(("llamacpp", "hf-"))
        contenders.append(parse_contender(target if peer or not contenders else load(), spec, server, gguf))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    with (out / "turns.jsonl").open("w") as log:
        def on_turn(row: dict) -> None:
            log.write(json.dumps(row) + "\n")
            log.flush()
            console.print(f"{row['conversation']} turn {row['turn']} ({row['turn_kind']}) {row['contender']}: "
                          f"{row['wall_s']:.2f} s, {row['new_tokens']} tokens, valid {row['valid']}", markup=False)

        rows = run_conversations(target, contenders, conversations, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, seed=args.seed, on_turn=on_turn)
    summary, machine = summarize_turns(rows), machine_info(target.device)
    header = (f"# {args.target}: {len(conversations)} conversations, {len(rows) // max(1, len(contenders))} turns, "
              f"T = {args.temperature:g}, at most {args.max_new_tokens} new tokens per turn\n\n"
              f"`{' '.join(['specwise', *sys.argv[1:]])}` on {machine.get('processor', '?')}")
    (out / "summary.json").write_text(json.dumps({"machine": machine, "rows": summary,
                                                  "described": {c.name: c.describe() for c in contenders
                                                                if c.describe is not None}}, indent=1))
    (out / "report.md").write_text(turns_markdown(summary, header))
    console.print(turns_markdown(summary, header), markup=False)
    return 0


def _other_target(args: argparse.Namespace, suffix: str):
    """The target of the contenders named ``method@SUFFIX``: an engine (``@llamacpp``, ``@torch``) or
    a weight form (``@bf16``, ``@native``) of the same file."""
    if suffix in ("torch", "llamacpp"):
        return load_target(args.target, dtype=args.dtype, device=args.device, weights=args.weights, engine=suffix)
    return load_target(args.target, dtype=args.dtype, device=args.device, weights=suffix)


def _response_format(args: argparse.Namespace) -> dict | None:
    """The run's ``response_format`` from ``--json-schema`` (``None`` without it).

    Raises:
        ConfigError: a file that cannot be read or is not JSON.
    """
    if args.json_schema is None:
        return None
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--json-schema {args.json_schema} cannot be read as JSON: {exc}.") from None
    return {"type": "json_schema", "json_schema": {"name": Path(args.json_schema).stem, "schema": schema}}


def _bench_prompts(args: argparse.Namespace) -> list:
    """The prompt records a ``bench`` run measures.

    Raises:
        ConfigError: the selection leaves no prompt.
    """
    records = load_prompts(args.prompts) if args.prompts else default_prompt_records()
    if args.held_out:
        records = [r for r in records if is_held_out(r)]
    if args.skip_per_category < 0:
        raise ConfigError(f"--skip-per-category must be >= 0, got {args.skip_per_category}.")
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}.")
    if args.per_category or args.skip_per_category:
        records = take_per_category(records, args.per_category or len(records), args.skip_per_category)
    if not records:
        raise ConfigError("no prompts to benchmark.")
    if args.instruction:
        records = [dataclasses.replace(r, prompt=f"{r.prompt}\n\n{args.instruction}") for r in records]
    return records
