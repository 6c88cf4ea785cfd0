"""``specwise generate``: one generation with one method, streamed or as one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from specwise.api import engine_for, generate, spec_and_config
from specwise.drafters.checkpoint import shipped_drafter
from specwise.drafters.spec import parse_option_value
from specwise.engine.grammar import grammar_source
from specwise.engine.sampling import SamplingConfig
from specwise.errors import ConfigError, DrafterError, PromptError
from specwise.lab.report import stats_table
from specwise.request import check_seed, check_stop_strings, check_text
from specwise.targets.aliases import KNOWN_TARGETS
from specwise.targets.chat import check_messages
from specwise.targets.engine_choice import ENGINE_HELP, ENGINES
from specwise.targets.loading import load_target, resolve_device
from specwise.targets.native.weights import WEIGHTS, WEIGHTS_HELP


def add_generate_args(p: argparse.ArgumentParser, default_target: str) -> None:
    """The flags of ``specwise generate``; sets ``func``."""
    _add_generate_args(p, default_target)
    p.set_defaults(func=cmd_generate)


def _add_generate_args(p: argparse.ArgumentParser, default_target: str) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="the prompt text (or --chat)")
    p.add_argument("--chat", default=None, metavar="TEXT",
                   help="a user message, sent through the target's chat template (instead of a raw prompt)")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--target", default=default_target,
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
    p.add_argument("--engine", default="auto", choices=["auto", *ENGINES], help=ENGINE_HELP + " (default auto)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    constrain = p.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", default=None, metavar="FILE",
                           help="constrain the output to JSON matching the schema in FILE")
    constrain.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    constrain.add_argument("--regex", default=None, metavar="PATTERN", help="constrain the output to match PATTERN")
    constrain.add_argument("--grammar", default=None, metavar="FILE",
                           help="constrain the output to the grammar in FILE (Lark; GBNF if it ends in .gbnf)")


def response_format(args: argparse.Namespace) -> dict | None:
    """The ``response_format`` the constraint options ask for (``None``: none), its files read and
    its shape checked before any model loads.

    Raises:
        ConfigError: a file that cannot be read, a schema that is not JSON, a bad shape.
    """
    if args.json_object:
        fmt = {"type": "json_object"}
    elif args.regex is not None:
        fmt = {"type": "regex", "pattern": args.regex}
    elif args.json_schema is not None:
        try:
            schema = json.loads(_read(args.json_schema, "--json-schema"))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--json-schema {args.json_schema} is not JSON: {exc.msg} at line {exc.lineno}.") from None
        fmt = {"type": "json_schema", "json_schema": {"name": Path(args.json_schema).stem, "schema": schema}}
    elif args.grammar is not None:
        fmt = {"type": "grammar", "grammar": _read(args.grammar, "--grammar"),
               "syntax": "gbnf" if args.grammar.endswith(".gbnf") else "lark"}
    else:
        return None
    grammar_source(fmt)
    return fmt


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ConfigError(f"{option} {path} cannot be read: {reason}.") from None


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
    fmt = response_format(args)
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
    engine = engine_for(args.engine, args.method, config, args.target)
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_progress, weights=args.weights,
                         engine=engine)
    streamer = None if args.json else _TextStreamer()
    result = generate(
        target, args.prompt, messages=messages, method=args.method, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        text_streamer=streamer, response_format=fmt, **options,
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
