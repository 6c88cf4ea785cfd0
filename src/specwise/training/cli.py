"""``specwise data build``, ``specwise train``, ``specwise export`` and ``specwise export-hf``."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

from specwise.drafters.checkpoint import read_config, shipped_drafter
from specwise.drafters.export import export_drafter, load_network, resolve_export
from specwise.errors import ConfigError, DrafterError
from specwise.interop.formats import prepare_out
from specwise.models.export import export_hf
from specwise.prompts import load_prompts
from specwise.targets.loading import load_target, resolve_dtype
from specwise.targets.native.weights import WEIGHTS, WEIGHTS_HELP
from specwise.training.corpus import SHARD_GLOB, CorpusConfig, build_corpus
from specwise.training.options import format_value, make_options, parse_value
from specwise.training.pipeline import TrainingJob
from specwise.training.precision import keep_freed_memory
from specwise.training.recipes import get_recipe, recipe_names


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
    build.add_argument("--chat", action="store_true",
                       help="send each prompt as a user message through the target's chat template")
    build.add_argument("--dtype", default="bfloat16")
    build.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    build.add_argument("--device", default=None)
    build.set_defaults(func=cmd_data_build)


def cmd_data_build(args: argparse.Namespace) -> int:

    config = CorpusConfig(
        new_tokens=args.new_tokens, batch_size=args.batch_size, sampled_fraction=args.sampled_fraction,
        temperature=args.temperature, max_prompt_tokens=args.max_prompt_tokens,
        continued_prompts=args.continued_prompts, text_only_prompts=args.text_only_prompts, seed=args.seed,
        chat=args.chat,
    )
    records = load_prompts(_expand(args.data))
    keep_freed_memory()
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_say, weights=args.weights)
    out = build_corpus(target, records, args.out, config, minutes=args.minutes, progress=_say)
    _say(f"corpus in {out}")
    return 0


class _RecipeParsers(argparse._SubParsersAction):
    """The ``METHOD`` of ``specwise train``: an unknown one gets the registry's error, which lists
    the recipes there are."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = None  # argparse's own "invalid choice" check would answer first; __call__ checks

    def __call__(self, parser, namespace, values, option_string=None):
        if values and values[0] not in self._name_parser_map:
            try:
                get_recipe(values[0])
            except ConfigError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
        super().__call__(parser, namespace, values, option_string)


def add_train_args(p: argparse.ArgumentParser, default_target: str) -> None:
    """``specwise train METHOD``: one sub-command per registered recipe, its flags generated from the
    recipe's options dataclass (:mod:`specwise.training.options`) plus ``--option KEY=VALUE``."""
    sub = p.add_subparsers(dest="method", metavar="METHOD", required=True, action=_RecipeParsers,
                           help=f"drafter to train: {', '.join(recipe_names())}")
    for name in recipe_names():
        spec = get_recipe(name)
        parser = sub.add_parser(name, help=spec.summary, description=spec.summary)
        _add_run_args(parser, default_target)
        add_option_flags(parser, spec.options_cls)
        parser.set_defaults(func=cmd_train)


def _add_run_args(p: argparse.ArgumentParser, default_target: str) -> None:
    """The flags of a training run that are not the recipe's options: what to load, read and write."""
    p.add_argument("--target", default=default_target)
    p.add_argument("--data", nargs="+", required=True,
                   help="a corpus directory (from `specwise data build`), or prompt JSONL files to build one from")
    p.add_argument("--out", required=True, help="output drafter directory (resumes when it holds a trainer state)")
    p.add_argument("--corpus-minutes", type=float, default=10.0, help="generation budget when --data are prompt files")
    p.add_argument("--dtype", default="bfloat16", help="dtype the target runs in")
    p.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    p.add_argument("--device", default=None)


#: where the generated flags keep their values in the parsed arguments (apart from the run's own)
_OPTION_DEST = "option__"


def add_option_flags(p: argparse.ArgumentParser, options_cls: type) -> None:
    """One ``--kebab-name`` flag per field of ``options_cls`` (help, choices and default from the
    field), flags sharing an ``exclusive`` group made mutually exclusive, and ``--option KEY=VALUE``."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for field in dataclasses.fields(options_cls):
        meta = field.metadata
        where = p
        if "exclusive" in meta:
            if meta["exclusive"] not in groups:
                groups[meta["exclusive"]] = p.add_mutually_exclusive_group()
            where = groups[meta["exclusive"]]
        shown = "none" if field.default is None else format_value(field.default)
        metavar = meta.get("metavar") or (None if "choices" in meta else field.name.upper())
        where.add_argument("--" + field.name.replace("_", "-"), dest=_OPTION_DEST + field.name,
                           default=argparse.SUPPRESS, choices=meta.get("choices"), metavar=metavar,
                           type=functools.partial(_flag_value, options_cls, field.name),
                           help=f"{meta.get('help', '')} (default: {shown})")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="set any option of this recipe by its name, e.g. --option lr=3e-4 (repeatable)")


def _flag_value(options_cls: type, name: str, text: str):
    try:
        return parse_value(options_cls, name, text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def options_from_args(options_cls: type, args: argparse.Namespace):
    """The recipe options given by the generated flags and ``--option KEY=VALUE``, over the defaults.

    Raises:
        ConfigError: a malformed ``--option``, an unknown key, a key also given as a flag, or a
            value out of range.
    """
    values = {k[len(_OPTION_DEST):]: v for k, v in vars(args).items() if k.startswith(_OPTION_DEST)}
    for item in getattr(args, "option", None) or []:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--option takes KEY=VALUE, got {item!r}.")
        if key in values:
            raise ConfigError(f"option {key} is given twice (a flag and --option, or --option twice).")
        if key not in {f.name for f in dataclasses.fields(options_cls)}:
            make_options(options_cls, {key: text})  # raises, listing the options
        values[key] = parse_value(options_cls, key, text)
    return make_options(options_cls, values)


def cmd_train(args: argparse.Namespace) -> int:

    spec = get_recipe(args.method)
    options = options_from_args(spec.options_cls, args)
    if options.init_from:  # fail before any features pass; the weights are checked in full later
        found = read_config(options.init_from).get("method")
        if found != spec.name:
            raise DrafterError(f"--init-from {options.init_from} holds a {found!r} drafter, not a {spec.name!r} one.")
    keep_freed_memory()  # this process trains: reuse big freed blocks instead of page-faulting new ones
    target = load_target(args.target, dtype=args.dtype, device=args.device, progress=_say, weights=args.weights)
    corpus = _corpus_from(args, options.seed, target)
    out = spec.train(TrainingJob(spec.name, target, corpus, Path(args.out), _say), options)
    _say(f"drafter written to {out}")
    return 0


def _corpus_from(args: argparse.Namespace, seed: int, target) -> Path:

    corpora = [Path(p) for p in args.data if Path(p).is_dir() and any(Path(p).glob(SHARD_GLOB))]
    if len(corpora) > 1:
        raise ConfigError("give one corpus directory (merge prompt files into one `specwise data build` instead).")
    if corpora:
        return corpora[0]
    records = load_prompts(_expand(args.data))
    return build_corpus(target, records, Path(args.out) / "corpus", CorpusConfig(seed=seed),
                        minutes=args.corpus_minutes, progress=_say)


def add_export_args(p: argparse.ArgumentParser, default_target: str) -> None:
    p.add_argument("drafter", nargs="?", default=None, help="draft LM directory (default: the shipped one)")
    p.add_argument("--target", default=default_target)
    p.add_argument("--out", required=True, help="HF model directory to write")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    p.set_defaults(func=cmd_export_hf)


def add_drafter_export_args(p: argparse.ArgumentParser, default_target: str) -> None:
    """``specwise export``: a drafter in the speculators (vLLM), SpecForge (SGLang) or Medusa format."""
    p.add_argument("drafter", nargs="?", default=None,
                   help="drafter directory, in any format --drafter reads (default: the one shipped for --method)")
    p.add_argument("--method", default=None, help="the drafter's method (eagle, medusa, dflash) when no directory is given")
    p.add_argument("--format", required=True, choices=["speculators", "eagle3", "medusa"],
                   help="speculators (vLLM), eagle3 (SpecForge / SGLang) or medusa (FasterDecoding)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--target", default=default_target, help=f"the target the drafter runs on (default {default_target})")
    p.add_argument("--verifier", default=None,
                   help="the target's name for vLLM/SGLang (default: its Hugging Face repository when known)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="draft tokens per step written in the config")
    p.add_argument("--unbounded-attention", action="store_true",
                   help="allow a head with an attention window into a format without windows (SpecForge)")
    p.add_argument("--dtype", default="bfloat16", help="weights' dtype of the export (default bfloat16)")
    p.add_argument("--weights", default="auto", choices=["auto", *WEIGHTS], help=WEIGHTS_HELP)
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:

    if args.speculative_tokens < 1:
        raise ConfigError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}.")
    resolve_export(args.target, args.format, args.drafter, args.method)  # the cheap refusals before the model load
    prepare_out(args.out, create=False)
    target = load_target(args.target, dtype="float32", device="cpu", progress=_say, weights=args.weights)
    exported = export_drafter(target, args.out, args.format, path=args.drafter, method=args.method,
                              dtype=resolve_dtype(args.dtype), verifier=args.verifier,
                              speculative_tokens=args.speculative_tokens, unbounded_attention=args.unbounded_attention)
    _say(f"wrote {exported.path} ({args.format} format)")
    for caveat in exported.caveats:
        _say(f"note: {caveat}")
    if not exported.serve:
        _say("no runtime serves this export as it is (see the notes); docs/interop.md says what does.")
    for runtime, command in exported.serve.items():
        print(f"# {runtime}\n{command}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:

    target = load_target(args.target, dtype=args.dtype, device="cpu", progress=_say, weights=args.weights)
    path = args.drafter or shipped_drafter(target, "draft")
    if path is None:
        raise DrafterError(f"no draft LM ships for {target.name}; give its directory.")
    out = export_hf(load_network("draft", path, target), target, args.out, resolve_dtype(args.dtype))
    _say(f"wrote a Hugging Face model to {out}")
    return 0
