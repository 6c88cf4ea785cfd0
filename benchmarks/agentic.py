"""Agentic traffic, turn by turn: tool calls, JSON answers, code edits and prose replies in
multi-turn conversations, on ``specwise serve`` (several methods, one server) and ``llama-server``
(several ``--spec-type`` configurations), in one run.

The conversations are built at run time from the project's prompt data (``../shared/data``, never
copied here; sources and licences in the SOURCES file beside it) and tools written for this benchmark
(:data:`TOOLS`), in three kinds:

- ``tools``: an XQuAD question (rag.jsonl, CC BY-SA 4.0) asked of an assistant with three tools;
  turn 1 must call one (``tool_choice: "required"``), the search result supplied is the question's
  passages, turn 2 answers from them, turn 3 asks for the supporting sentence, quoted;
- ``json``: passages and a question answered as JSON (a fixed schema), then a second question on
  the same passages in the same schema;
- ``code``: an MBPP task (code.jsonl, CC BY 4.0) written, then edited twice (type hints and a
  docstring; tests added), each reply the whole code again.

Every contender reads the same tokens: each turn is run by our ``ar`` first and its reply goes into
the history of every contender's next turn. Each of our methods runs on a server of its own at its
defaults (so each keeps its own conversation's prefix and, for ``suffix`` and ``auto``, its own
index of earlier replies), as each llama-server configuration does. llama-server gets the prompt as token ids rendered by
the target's own chat template (tools included), and a call turn as the prompt followed by the call's
opening marker with the call's JSON schema as ``json_schema`` (b11434's own tool calling did not
produce calls on this model; docs/benchmarks/agentic-qwen-report.md). Our server keeps prefix reuse on
(its default), llama-server ``cache_prompt`` on (its default), both ``--poll 0``-style idle.

Measured per turn: wall time from request to full reply (prefill included), completion tokens from
each server's own count, whether the turn's output is valid (a parsed call, JSON that parses, a
non-empty reply), τ where the server reports it. Results are appended to ``turns.jsonl`` as they
come (a rerun with the same ``--out`` skips conversations already there).

    python benchmarks/agentic.py --llama-server PATH [--conversations 6] [--out runs/agentic]
    python benchmarks/agentic.py --export runs/agentic.jsonl [--conversations 2] [--tune]
        # the conversations alone, as JSON Lines for `specwise bench --conversations FILE`
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import Contender, free_port  # noqa: E402

from specwise.drafters.spec import split_spec, split_specs  # noqa: E402
from specwise.prompts import PromptRecord, is_held_out, load_prompts  # noqa: E402
from specwise.targets.files import gguf_file  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

TOOLS = [
    {"type": "function", "function": {
        "name": "search_documents", "description": "Search the document collection and return the passages that match.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to search for"},
            "top_k": {"type": "integer", "description": "how many passages to return"}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
]
SYSTEM = "You are a research assistant. Use the tools to find information before you answer."
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "evidence": {"type": "string"}}, "required": ["answer", "evidence"],
    "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}


def split_rag(prompt: str) -> tuple[str, str] | None:
    """``(passages, question)`` of a rag.jsonl prompt."""
    head, sep, question = prompt.rpartition("\n\nQuestion: ")
    if not sep:
        return None
    passages = head.split("\n\n", 1)[1] if "\n\n" in head else head
    return passages, question.strip()


def build(count: int, held_out: bool = True) -> list[dict]:
    """``count`` conversations per kind, from the evaluation split (or the tuning split)."""
    def pick(name: str, keep) -> list[PromptRecord]:
        records = [r for r in load_prompts([DATA / name]) if is_held_out(r) == held_out and keep(r)]
        return records[:count * 2]

    conversations = []
    for record in pick("rag.jsonl", lambda r: split_rag(r.prompt) is not None)[:count]:
        passages, question = split_rag(record.prompt)
        conversations.append({"id": f"tools/{record.id}", "kind": "tools", "system": SYSTEM, "tools": TOOLS, "turns": [
            {"user": question, "tool_choice": "required", "turn": "tool call"},
            {"tool_result": passages, "turn": "prose"},
            {"user": "Quote the sentence from the search results that supports your answer.", "turn": "prose"}]})
    rag = pick("rag.jsonl", lambda r: split_rag(r.prompt) is not None)
    for first, second in zip(rag[count:2 * count], rag[:count]):
        passages, question = split_rag(first.prompt)
        _, other = split_rag(second.prompt)
        conversations.append({"id": f"json/{first.id}", "kind": "json", "turns": [
            {"user": f"{passages}\n\nQuestion: {question}\nAnswer in JSON with the fields \"answer\" and \"evidence\" "
                     "(a sentence quoted from the passages).", "response_format": JSON_FORMAT, "turn": "JSON"},
            {"user": f"Question: {other}\nAnswer in the same JSON format.", "response_format": JSON_FORMAT,
             "turn": "JSON"}]})
    for record in pick("code.jsonl", lambda r: "/mbpp/" in r.id)[:count]:
        conversations.append({"id": f"code/{record.id}", "kind": "code", "turns": [
            {"user": record.prompt, "turn": "code"},
            {"user": "Add type hints and a docstring to the function. Reply with the complete code only.",
             "turn": "code"},
            {"user": "Now add three assert statements that test it below the function. Reply with the complete "
                     "code only.", "turn": "code"}]})
    return conversations


def ask_ours(url: str, model: str, messages: list[dict], turn: dict, tools, max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if tools:
        body["tools"] = tools
        body["tool_choice"] = turn.get("tool_choice", "auto")
    if turn.get("response_format"):
        body["response_format"] = turn["response_format"]
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900).json()
    wall = time.perf_counter() - start
    if "error" in reply:
        return {"wall_s": wall, "error": reply["error"]["message"], "valid": False}
    message = reply["choices"][0]["message"]
    spec = reply.get("speculative_decoding", {})
    return {"wall_s": wall, "tokens": reply["usage"]["completion_tokens"], "message": message,
            "tau": spec.get("mean_accepted_length"), "method_steps": spec.get("method_steps"),
            "valid": valid(turn, message.get("content"), message.get("tool_calls"))}


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call of any of ``tools`` (what follows the call's opening marker)."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "arguments": t["function"]["parameters"]},
                       "required": ["name", "arguments"]} for t in tools]}


def ask_llama(url: str, target, messages: list[dict], turn: dict, tools, max_tokens: int) -> dict:
    ids = target.encode_chat(messages, tools=tools or None).tolist()
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "cache_prompt": True,
            "stream": False}
    schema = None
    if turn.get("tool_choice") == "required":
        ids += target.tokenizer("<tool_call>\n", add_special_tokens=False).input_ids
        body["prompt"], schema = ids, call_schema(tools)
    elif turn.get("response_format"):
        schema = turn["response_format"]["json_schema"]["schema"]
    if schema is not None:
        body["json_schema"] = schema
    start = time.perf_counter()
    reply = httpx.post(f"{url}/completion", json=body, timeout=900).json()
    wall = time.perf_counter() - start
    if "error" in reply:
        return {"wall_s": wall, "error": str(reply["error"]), "valid": False}
    timings = reply.get("timings", {})
    drafted, accepted = timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)
    text = reply.get("content", "")
    calls = None
    if turn.get("tool_choice") == "required":
        try:
            calls = [json.loads(text)]
        except ValueError:
            calls = None
    return {"wall_s": wall, "tokens": timings.get("predicted_n", reply.get("tokens_predicted")), "text": text,
            "drafted": drafted, "accepted": accepted, "valid": valid(turn, text, calls)}


def valid(turn: dict, content: str | None, calls) -> bool:
    if turn.get("tool_choice") == "required":
        return bool(calls)
    if turn.get("response_format"):
        try:
            json.loads(content or "")
            return True
        except ValueError:
            return False
    return bool((content or "").strip()) or bool(calls)


def history_reply(result: dict) -> dict:
    """Our ``ar`` reply as the history's assistant message (its tool calls with ids)."""
    message = result["message"]
    reply = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    return reply


def run_conversation(conversation: dict, ours: dict, model: str, llamas: dict, target, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": conversation["system"]}] if conversation.get("system") else []
    tools = conversation.get("tools")
    rows = []
    last_call = None
    for index, turn in enumerate(conversation["turns"]):
        if "tool_result" in turn:
            messages.append({"role": "tool", "content": turn["tool_result"],
                             "tool_call_id": last_call or "call_0"})
        else:
            messages.append({"role": "user", "content": turn["user"]})
        results = {}
        # the order rotates turn by turn, so no contender always runs first (this machine's speed
        # drifts over minutes; a fixed order would favour whoever meets the faster stretch)
        order = [(name, url, True) for name, url in ours.items()] + [(name, url, False) for name, url in llamas.items()]
        shift = (len(conversation["id"]) + index) % len(order)
        for name, url, mine in order[shift:] + order[:shift]:
            if mine:
                results[name] = ask_ours(url, model, messages, turn, tools, max_tokens)
            else:
                results[name] = ask_llama(url, target, messages, turn, tools, max_tokens)
        results = {name: results[name] for name, _, _ in order}
        reference = results[next(iter(ours))]
        for name, result in results.items():
            same = None
            if name.startswith("specwise") and "message" in result and "message" in reference:
                same = result["message"] == reference["message"]
            row = {"conversation": conversation["id"], "kind": conversation["kind"], "turn": index,
                   "turn_kind": turn["turn"], "contender": name, "same_as_ar": same,
                   **{k: v for k, v in result.items() if k not in ("message", "text")}}
            if result is reference and "message" in result:
                row["reply"] = history_reply(result)  # the history every contender's next turn reads
            rows.append(row)
        if "message" not in reference:
            break
        messages.append(history_reply(reference))
        calls = reference["message"].get("tool_calls") or []
        last_call = calls[0]["id"] if calls else None
    return rows


def converse(conversation: dict, ask, replies: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """One contender through one conversation: ``ask(messages, turn, tools) -> result``. The
    history is the contender's own replies (the reference run) or ``replies`` (the reference's,
    turn by turn). Returns the per-turn results and the replies the history took."""
    messages = [{"role": "system", "content": conversation["system"]}] if conversation.get("system") else []
    tools = conversation.get("tools")
    results, taken, last_call = [], [], None
    for index, turn in enumerate(conversation["turns"]):
        if replies is not None and index > len(replies):
            break
        if "tool_result" in turn:
            messages.append({"role": "tool", "content": turn["tool_result"], "tool_call_id": last_call or "call_0"})
        else:
            messages.append({"role": "user", "content": turn["user"]})
        result = ask(messages, turn, tools)
        results.append(result)
        if replies is None:
            if "message" not in result:
                break
            reply = history_reply(result)
        elif index < len(replies):
            reply = replies[index]
        else:
            break
        taken.append(reply)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        last_call = calls[0]["id"] if calls else None
    return results, taken


def run_concurrently(conversations: list[dict], ours: dict, model: str, llamas: dict, target,
                     max_tokens: int) -> list[dict]:
    """Every contender serves all ``conversations`` at once (a client each), one contender after
    another: the first of ours first, whose replies are then every other contender's history.
    Each row is one turn; ``burst_s`` is the contender's time to finish every conversation."""
    from concurrent.futures import ThreadPoolExecutor

    def asker(name: str, url: str):
        if name in ours:
            return lambda messages, turn, tools: ask_ours(url, model, messages, turn, tools, max_tokens)
        return lambda messages, turn, tools: ask_llama(url, target, messages, turn, tools, max_tokens)

    contenders = {**ours, **llamas}
    reference = next(iter(ours))
    replies: dict[str, list[dict]] = {}
    rows = []
    for name, url in contenders.items():
        start = time.perf_counter()
        with ThreadPoolExecutor(len(conversations)) as pool:
            futures = {c["id"]: pool.submit(converse, c, asker(name, url),
                                            None if name == reference else replies.get(c["id"], []))
                       for c in conversations}
            done = {cid: future.result() for cid, future in futures.items()}
        burst = time.perf_counter() - start
        for conversation in conversations:
            results, taken = done[conversation["id"]]
            if name == reference:
                replies[conversation["id"]] = taken
            for index, result in enumerate(results):
                rows.append({"conversation": conversation["id"], "kind": conversation["kind"], "turn": index,
                             "turn_kind": conversation["turns"][index]["turn"], "contender": name,
                             "clients": len(conversations), "burst_s": burst,
                             **{k: v for k, v in result.items() if k not in ("message", "text")}})
        print(f"{name}: {len(conversations)} conversations at once in {burst:.1f} s", flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    lines = ["| contender | turn kind | turns | valid | wall s (sum) | tokens | tok/s | vs specwise ar | τ |",
             "|---|---|---|---|---|---|---|---|---|"]
    kinds = ["all", *dict.fromkeys(r["turn_kind"] for r in rows)]
    for kind in kinds:
        base = sum(r["wall_s"] for r in rows if r["contender"] == contenders[0] and kind in ("all", r["turn_kind"]))
        for name in contenders:
            mine = [r for r in rows if r["contender"] == name and kind in ("all", r["turn_kind"])]
            wall = sum(r["wall_s"] for r in mine)
            tokens = sum(r.get("tokens") or 0 for r in mine)
            taus = [r["tau"] for r in mine if r.get("tau")]
            drafted = sum(r.get("drafted", 0) for r in mine)
            tau = f"{statistics.median(taus):.2f}" if taus else (
                f"acc {sum(r.get('accepted', 0) for r in mine) / drafted:.2f}" if drafted else "-")
            lines.append(f"| {name} | {kind} | {len(mine)} | {sum(bool(r['valid']) for r in mine)} | {wall:.1f} | "
                         f"{tokens} | {tokens / wall if wall else 0:.1f} | {base / wall if wall else 0:.2f}x | {tau} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--export", type=Path, default=None, metavar="FILE",
                        help="write the conversations as JSON Lines (for specwise bench --conversations) and stop")
    parser.add_argument("--methods", default="ar,suffix,auto,auto[floor=suffix]",
                        help="our methods, a server each at its defaults; the first is the reference")
    parser.add_argument("--spec-types", default="none,ngram-mod,ngram-map-k,ngram-simple",
                        help="llama-server configurations: its plain decoding (none) and --spec-type values")
    parser.add_argument("--conversations", type=int, default=2, help="per kind")
    parser.add_argument("--tune", action="store_true", help="the tuning split instead of the held-out one")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", type=int, default=1,
                        help="conversations served at once (a client each); > 1: every contender serves "
                             "--clients conversations together, llama-server with -np CLIENTS")
    parser.add_argument("--out", type=Path, default=Path("runs/agentic"))
    args = parser.parse_args()
    if args.export:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        conversations = build(args.conversations, held_out=not args.tune)
        args.export.write_text("".join(json.dumps(c) + "\n" for c in conversations))
        print(f"wrote {len(conversations)} conversations to {args.export}")
        return
    if args.llama_server is None:
        parser.error("--llama-server is required (except with --export)")
    import specwise

    args.out.mkdir(parents=True, exist_ok=True)
    done_path = args.out / "turns.jsonl"
    done = {json.loads(line)["conversation"] for line in done_path.open()} if done_path.exists() else set()
    conversations = build(args.conversations, held_out=not args.tune)
    (args.out / "conversations.json").write_text(json.dumps(conversations, indent=1))
    gguf = gguf_file(args.target)
    target = specwise.load_target(args.target, engine="llamacpp")
    servers, ours, llamas = {}, {}, {}
    for spec in split_specs(args.methods):  # a server each, so each keeps its own conversation's prefix
        port = free_port()
        method, options = split_spec(spec)
        name = f"specwise {spec}"
        flags = [item for key, value in options.items() for item in ("--option", f"{key}={value}")]
        servers[name] = Contender(name, [sys.executable, "-m", "specwise.cli", "serve", "--target", args.target,
                                         "--engine", "llamacpp", "--port", str(port), "--log-level", "warning",
                                         "--method", method, *flags], port,
                                  args.out / f"specwise-{len(servers)}-{method}.log")
        ours[name] = servers[name].url
    for spec in args.spec_types.split(","):
        port = free_port()
        command = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t",
                   str(args.threads), "-tb", str(args.threads), "--poll", "0", "-c", str(8192 * args.clients),
                   "-np", str(args.clients)]
        if spec != "none":
            command += ["--spec-type", spec]
        name = "llama-server" if spec == "none" else f"llama-server {spec}"
        servers[name] = Contender(name, command, port, args.out / f"{name.replace(' ', '-')}.log")
        llamas[name] = servers[name].url
    try:
        for server in servers.values():
            server.wait()
        # each server's first request pays what later ones do not (auto measures its candidates on
        # built-in texts once per machine, llama.cpp warms up): one short exchange first, not counted
        warm = {"turns": [{"user": "Write a haiku about the sea.", "turn": "prose"}], "id": "warm-up", "kind": "warm-up"}
        run_conversation(warm, ours, args.target, llamas, target, 32)
        if args.clients > 1:
            # one of each kind in turn, so the clients' mix is the workload's
            mixed = sorted(conversations, key=lambda c: [x["id"] for x in conversations if x["kind"] == c["kind"]]
                           .index(c["id"]))
            rows = run_concurrently(mixed[: args.clients], ours, args.target, llamas, target, args.max_tokens)
            (args.out / "concurrent.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            bursts = {row["contender"]: row["burst_s"] for row in rows}
            turns = {name: sum(1 for row in rows if row["contender"] == name and row["valid"]) for name in bursts}
            base = bursts[next(iter(ours))]
            table = "\n".join(f"| {name} | {turns[name]} | {burst:.1f} | {base / burst:.2f}x |"
                              for name, burst in bursts.items())
            (args.out / "concurrent.md").write_text(
                f"| contender | valid turns | all conversations at once, s | vs specwise ar |\n|---|---|---|---|\n{table}\n")
            print(table)
            return
        with done_path.open("a") as out:
            for conversation in conversations:
                if conversation["id"] in done:
                    continue
                rows = run_conversation(conversation, ours, args.target, llamas, target, args.max_tokens)
                for row in rows:
                    out.write(json.dumps(row) + "\n")
                out.flush()
                print(f"{conversation['id']}: " + ", ".join(f"{r['contender']} {r['wall_s']:.1f}s" for r in rows
                                                            if r["turn"] == 0), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    rows = [json.loads(line) for line in done_path.open()]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    (args.out / "report.md").write_text(f"# Agentic turns: {args.target}\n\nCPU: {cpu}; llama-server "
                                        f"{args.llama_server}\n\n{summary(rows)}\n")
    print(summary(rows))


if __name__ == "__main__":
    main()
