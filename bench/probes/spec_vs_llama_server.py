"""Speculative decoding over HTTP, side by side with llama.cpp's own server (issue 41's speed lines).

Sides, each a server process started here, all driven by the same client (``bench.client``):

* ``kvserve plain``: ``kvserve serve --num-threads T`` (speculation off);
* ``kvserve ngram`` / ``kvserve suffix``: the same with ``--speculative-config`` (``--methods``;
  ngram: ``k`` draft tokens, prompt lookup ``--ngram-min``..``--ngram-max``; suffix: ``k`` and the
  rest at their defaults);
* ``llama-server``: llama.cpp's server at its defaults (no speculation) on the same GGUF (the shipped
  Q4_1 file, the one kvserve serves), ``-t``/``-tb`` T, one slot (``scripts/llama-server-peer.sh``);
* ``llama-server ngram-*``: the same with its own draft-free n-gram speculation
  (``--llama-ngram``: the flag sets in ``LLAMA_NGRAM``).

The requests: streamed ``/v1/completions`` with token-id prompts rendered by kvserve's tokenizer
with the model's chat template (``engine.tokenizer.encode_chat``), so every side decodes from the
very same ids; ``/v1/chat/completions`` would render the template twice, through two template
engines (transformers' jinja and llama.cpp's), which need not give the same ids. Greedy
(``temperature 0``), ``max_tokens`` (default 128) with ``ignore_eos``, so every side decodes the same
number of tokens whatever its numerics (the tokens after an answer's EOS are the model's own
continuation, the same on every side up to its numerics). One request at a time (single stream).

Prompt classes: three copy-heavy ones as the issue names them (``repeat-edit``: a passage repeated
with one edit; ``quote``: an answer quoting a given document; ``code-edit``: an edit of a 60-line
function) and ``chat`` (ordinary questions, ``bench.workload.chat_prompts``); ``copy`` is the three
copy classes together. The figure is single-stream decode tok/s = 1 / mean TPOT over a class's
requests (prefill left out, as ``bench.vs_llama_server``). Each round runs every class on every
side, the side order reversed every other round; a ratio is the median of the rounds' ratios (each
round's runs of a class are adjacent in time), each side's tok/s the median round's. Acceptance
rate = accepted / drafted tokens per class, from kvserve's ``/metrics`` counter deltas
(``kvserve_spec_decode_num_{draft,accepted}_tokens_total``) and from llama-server's log (its
``draft acceptance = ... ( A accepted / G generated)`` line per request). Beside it: the weight
format of each side and the cores other processes used meanwhile (``bench.machine.LoadMonitor``).

    python -m bench.probes.spec_vs_llama_server                       # ngram k=4, 3 rounds
    python -m bench.probes.spec_vs_llama_server --methods ngram,suffix --rounds 5
    python -m bench.probes.spec_vs_llama_server --no-llama            # the kvserve sides only
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bench.probes.spec_decode import COPY_TASKS

# ---- the prompts --------------------------------------------------------------------------------
# A 60-line function for the code-edit class (COPY_TASKS' own function is 13 lines).
FUNCTION_60 = '''def summarize_orders(orders, currency="EUR", min_total=0.0):
    """Group orders by customer and return a summary per customer.

    Each order is a dict with the keys customer, amount, currency, status and items.
    Orders in another currency are converted with a fixed table; cancelled orders
    are skipped; customers whose total is below min_total are left out.
    """
    rates = {"EUR": 1.0, "USD": 0.92, "GBP": 1.17, "CHF": 1.04}
    if currency not in rates:
        raise ValueError(f"unknown currency: {currency}")
    summary = {}
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        customer = order["customer"]
        source = order.get("currency", "EUR")
        if source not in rates:
            raise ValueError(f"unknown currency in order: {source}")
        amount = order["amount"] * rates[source] / rates[currency]
        entry = summary.setdefault(customer, {
            "orders": 0,
            "total": 0.0,
            "largest": 0.0,
            "items": 0,
            "first_status": order.get("status", "open"),
        })
        entry["orders"] += 1
        entry["total"] += amount
        entry["items"] += len(order.get("items", []))
        if amount > entry["largest"]:
            entry["largest"] = amount
    result = []
    for customer, entry in summary.items():
        if entry["total"] < min_total:
            continue
        average = entry["total"] / entry["orders"]
        result.append({
            "customer": customer,
            "orders": entry["orders"],
            "total": round(entry["total"], 2),
            "average": round(average, 2),
            "largest": round(entry["largest"], 2),
            "items": entry["items"],
            "status": entry["first_status"],
        })
    result.sort(key=lambda row: row["total"], reverse=True)
    return result


def print_summary(rows, currency="EUR"):
    """Print the rows of summarize_orders as a small table."""
    if not rows:
        print("no orders")
        return
    width = max(len(str(row["customer"])) for row in rows)
    print("customer".ljust(width), "orders", "total", "average")
    for row in rows:
        name = str(row["customer"]).ljust(width)
        print(name, row["orders"], f"{row['total']:.2f} {currency}",
              f"{row['average']:.2f} {currency}")
'''

COPY_CLASSES: dict[str, str] = {
    "repeat-edit": COPY_TASKS[0],  # "Repeat the following paragraph exactly, but write 'lantern' instead of 'lamp'"
    "quote": COPY_TASKS[1],  # quote two sentences of a given document word for word
    "code-edit": "Rename the variable `entry` to `stats` everywhere in the code below and return the whole "
                 f"code with that one change:\n\n```python\n{FUNCTION_60}```",
}
CHAT_CLASS = "chat"
COPY = "copy"  # the copy classes together


def prompt_texts(chat_prompts: int = 3) -> dict[str, list[str]]:
    """The user messages of each class (the copy classes one prompt each)."""
    from bench.workload import CHAT_QUESTIONS

    out = {name: [text] for name, text in COPY_CLASSES.items()}
    out[CHAT_CLASS] = [CHAT_QUESTIONS[(1 + i) % len(CHAT_QUESTIONS)] for i in range(chat_prompts)]
    return out


def prompt_ids(tokenizer: Any, chat_prompts: int = 3) -> dict[str, list[list[int]]]:
    """Each class's prompts as token ids, rendered with the model's chat template."""
    from engine.tokenizer import encode_chat

    return {name: [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]
            for name, texts in prompt_texts(chat_prompts).items()}


# ---- the sides ----------------------------------------------------------------------------------
# llama-server's draft-free n-gram speculation (llama.cpp-tools 0.7.0, build 11669: --spec-type
# none,draft-*,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache). ngram-simple with a
# 3-token lookup and 4-token drafts is the closest to kvserve's ngram (lookup 1..3, k=4);
# ngram-mod at its own defaults (match 24, drafts of 48..64) is the one llama.cpp tunes itself.
LLAMA_NGRAM: dict[str, tuple[str, ...]] = {
    "simple": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4"),
    "mod": ("--spec-type", "ngram-mod"),
}
PLAIN = "kvserve plain"
LLAMA = "llama-server"


@dataclass(frozen=True)
class Side:
    name: str
    kind: str  # "kvserve" or "llama"
    args: tuple[str, ...] = field(default=())  # kvserve serve args / llama-server extra args
    spec: bool = False


def spec_config(method: str, k: int, ngram_min: int = 1, ngram_max: int = 3) -> str:
    """``--speculative-config`` JSON for kvserve."""
    cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        cfg.update(prompt_lookup_min=ngram_min, prompt_lookup_max=ngram_max)
    return json.dumps(cfg, separators=(",", ":"))


def make_sides(methods: Sequence[str], k: int, ngram_min: int = 1, ngram_max: int = 3,
               llama_ngram: Sequence[str] = ("simple", "mod"), llama: bool = True) -> list[Side]:
    sides = [Side(PLAIN, "kvserve")]
    sides += [Side(f"kvserve {m}", "kvserve", ("--speculative-config", spec_config(m, k, ngram_min, ngram_max)), True)
              for m in methods]
    if llama:
        sides.append(Side(LLAMA, "llama"))
        sides += [Side(f"{LLAMA} ngram-{n}", "llama", LLAMA_NGRAM[n], True) for n in llama_ngram]
    return sides


# ---- the arithmetic -----------------------------------------------------------------------------
def ratio_of(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def median_ratio(nums: Sequence[float | None], dens: Sequence[float | None]) -> tuple[float | None, list[float]]:
    """The median of the per-round ratios ``nums[r] / dens[r]`` (rounds with a missing side left
    out) and the ratios themselves."""
    rounds = [r for r in (ratio_of(a, b) for a, b in zip(nums, dens)) if r is not None]
    return (round(statistics.median(rounds), 3) if rounds else None), rounds


def median_value(values: Sequence[float | None]) -> float | None:
    """The median round's value (the lower one of an even count), as ``_median_run`` in vs_llama_server."""
    vals = sorted(v for v in values if v is not None)
    return vals[(len(vals) - 1) // 2] if vals else None


def acceptance(drafted: float | None, accepted: float | None) -> float | None:
    return round(accepted / drafted, 3) if drafted and accepted is not None else None


def round_order(sides: Sequence[Side], r: int) -> list[Side]:
    """Round r's order: as given in even rounds, reversed in odd ones."""
    return list(sides) if r % 2 == 0 else list(sides)[::-1]


LLAMA_ACCEPT = re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)")


def llama_log_drafts(text: str) -> tuple[int, int]:
    """(drafted, accepted) summed over llama-server's per-request ``draft acceptance`` log lines."""
    drafted = accepted = 0
    for m in LLAMA_ACCEPT.finditer(text):
        accepted += int(m.group(1))
        drafted += int(m.group(2))
    return drafted, accepted


# ---- running ------------------------------------------------------------------------------------
def _start(side: Side, threads: int, gguf: Path, log: Path, max_len: int) -> Any:
    if side.kind == "kvserve":
        from bench.server import start_subprocess

        return start_subprocess(["--num-threads", str(threads), *side.args], log_path=log)
    from bench.peers.llama_server import LlamaServerConfig, ctx_size_for, start_llama_server
    from bench.server import free_port

    return start_llama_server(LlamaServerConfig(gguf, free_port(), threads, parallel=1,
                                                ctx_size=ctx_size_for(1, max_len), extra=side.args), log)


def _drafts(server: Any, side: Side, log: Path) -> tuple[float, float] | None:
    """(drafted, accepted) so far: kvserve's /metrics counters, llama-server's log lines."""
    if not side.spec:
        return None
    if side.kind == "kvserve":
        from bench.client import scrape_metrics

        m = scrape_metrics(server) or {}
        return (m.get("kvserve_spec_decode_num_draft_tokens_total", 0.0),
                m.get("kvserve_spec_decode_num_accepted_tokens_total", 0.0))
    try:
        return llama_log_drafts(log.read_text(errors="replace"))
    except OSError:
        return None


def _measure(server: Any, side: Side, log: Path, prompts: Sequence[Sequence[int]], max_tokens: int,
             idle_pids: Sequence[int] = ()) -> dict[str, Any]:
    """One side's requests one at a time; the cores other processes used meanwhile, and of those
    the cores the other sides' (idle) servers used."""
    from bench.client import completion_request, run_load
    from bench.machine import LoadMonitor, tree_cpu_seconds

    before = _drafts(server, side, log)
    idle0 = sum(tree_cpu_seconds(p) for p in idle_pids)
    with LoadMonitor([server.pid]) as mon:
        records, elapsed = run_load(server, [completion_request(p, max_tokens) for p in prompts], 1)
    idle_cores = round((sum(tree_cpu_seconds(p) for p in idle_pids) - idle0) / max(elapsed, 1e-9), 3)
    time.sleep(0.05 if side.kind == "kvserve" else 0.3)  # llama-server logs a request's timings after its last chunk
    after = _drafts(server, side, log)
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{side.name}: {len(errors)} request(s) failed: {errors[0]}")
    drafted = accepted = None
    if before is not None and after is not None:
        drafted, accepted = after[0] - before[0], after[1] - before[1]
    return {"records": records, "elapsed_s": elapsed, "drafted": drafted, "accepted": accepted,
            "foreign_cores": mon.foreign_cores, "idle_sides_cores": idle_cores}


def summarize_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One side's runs of one class in one round (several classes for ``copy``), summarized."""
    from bench.client import summarize

    records = [r for run in runs for r in run["records"]]
    s = summarize(records, sum(run["elapsed_s"] for run in runs))
    drafted = [run["drafted"] for run in runs]
    accepted = [run["accepted"] for run in runs]
    d = sum(drafted) if None not in drafted else None
    a = sum(accepted) if None not in accepted else None
    loads = [run["foreign_cores"] for run in runs if run["foreign_cores"] is not None]
    idle = [run.get("idle_sides_cores") or 0.0 for run in runs]
    return {"tok_s": s["stream_decode_tps"], "tpot_p50_ms": s["tpot_p50_ms"], "output_tokens": s["output_tokens"],
            "drafted": d, "accepted": a, "acceptance": acceptance(d, a),
            "foreign_cores": round(max(loads), 2) if loads else None, "idle_sides_cores": round(max(idle), 3),
            "texts": [r.text for r in records]}


def tabulate(per_round: list[dict[str, dict[str, dict[str, Any]]]], sides: Sequence[Side],
             classes: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``per_round[r][class][side]`` (``summarize_runs``) -> ``{class: {side: row}}``: the median
    round's tok/s, acceptance over all rounds, the worst load, and for a speculating kvserve side
    the median-of-rounds ratios against kvserve plain, llama-server and each llama-server ngram."""
    names = [s.name for s in sides]
    llama_ngram = [s.name for s in sides if s.kind == "llama" and s.spec]
    out: dict[str, dict[str, Any]] = {}
    for cls in classes:
        rows: dict[str, Any] = {}
        tps = {n: [rnd[cls][n]["tok_s"] if n in rnd[cls] else None for rnd in per_round] for n in names}
        for side in sides:
            runs = [rnd[cls][side.name] for rnd in per_round if side.name in rnd[cls]]
            if not runs:
                continue
            d = [r["drafted"] for r in runs]
            a = [r["accepted"] for r in runs]
            loads = [r["foreign_cores"] for r in runs if r["foreign_cores"] is not None]
            row: dict[str, Any] = {
                "tok_s": median_value(tps[side.name]), "round_tok_s": tps[side.name],
                "tpot_p50_ms": median_value([r["tpot_p50_ms"] for r in runs]),
                "output_tokens": runs[0]["output_tokens"],
                "acceptance": acceptance(sum(d), sum(a)) if None not in d and None not in a else None,
                "drafted": sum(d) if None not in d else None, "accepted": sum(a) if None not in a else None,
                "foreign_cores_max": max(loads) if loads else None,
                "foreign_cores_rounds": [r["foreign_cores"] for r in runs],
                "idle_sides_cores_max": max(r.get("idle_sides_cores") or 0.0 for r in runs),
                "same_text_as_plain": (sum(r["texts"] == rnd[cls][PLAIN]["texts"]
                                           for r, rnd in zip(runs, per_round) if PLAIN in rnd[cls])
                                       if side.name != PLAIN else None),
            }
            if side.kind == "kvserve" and side.spec:
                for other, key in [(PLAIN, "vs_plain"), (LLAMA, "vs_llama")] + [(n, f"vs_{n}") for n in llama_ngram]:
                    if other in tps:
                        row[key], row[key + "_rounds"] = median_ratio(tps[side.name], tps[other])
            rows[side.name] = row
        out[cls] = rows
    return out


def run_probe(sides: Sequence[Side], prompts: dict[str, list[list[int]]], threads: int = 2, max_tokens: int = 128,
              rounds: int = 3, gguf: Path | None = None, log_dir: Path | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Start every side's server, run ``rounds`` rounds of every class on every side, stop them."""
    from bench.client import completion_request, run_load
    from bench.machine import machine_info
    from engine.loader import default_gguf_path

    gguf = Path(gguf or default_gguf_path())
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="spec-vs-llama-"))
    max_len = max(len(p) for ps in prompts.values() for p in ps) + max_tokens + 16
    servers: dict[str, Any] = {}
    logs = {s.name: log_dir / (s.name.replace(" ", "_") + ".log") for s in sides}
    per_round: list[dict[str, dict[str, dict[str, Any]]]] = []
    try:
        for side in sides:
            if progress:
                print(f"starting {side.name} {' '.join(side.args)} (log {logs[side.name]})", flush=True)
            servers[side.name] = _start(side, threads, gguf, logs[side.name], max_len)
            warm = next(iter(prompts.values()))[0]
            run_load(servers[side.name], [completion_request(warm[:24], 8)], 1)  # warm-up
        for r in range(rounds):
            rnd: dict[str, dict[str, Any]] = {}
            raw: dict[str, dict[str, dict[str, Any]]] = {}
            for cls, ps in prompts.items():
                raw[cls] = {}
                for side in round_order(sides, r):
                    idle = [s.pid for n, s in servers.items() if n != side.name and s.pid]
                    raw[cls][side.name] = _measure(servers[side.name], side, logs[side.name], ps, max_tokens, idle)
                rnd[cls] = {n: summarize_runs([run]) for n, run in raw[cls].items()}
                if progress:
                    print(f"round {r + 1}/{rounds} {cls}: " + ", ".join(f"{n} {s['tok_s']}" for n, s in rnd[cls].items()),
                          flush=True)
            copy = [c for c in COPY_CLASSES if c in raw]
            if len(copy) > 1:
                rnd[COPY] = {s.name: summarize_runs([raw[c][s.name] for c in copy]) for s in sides}
            per_round.append(rnd)
    finally:
        for server in servers.values():
            server.close()
    classes = list(per_round[0]) if per_round else []
    return {"probe": "spec_vs_llama_server", "sides": [{"name": s.name, "kind": s.kind, "args": list(s.args)}
                                                       for s in sides],
            "threads": threads, "max_tokens": max_tokens, "rounds": rounds, "gguf": str(gguf),
            "prompt_tokens": {c: [len(p) for p in ps] for c, ps in prompts.items()},
            "classes": tabulate(per_round, sides, classes), "logs": str(log_dir), "machine": machine_info()}


def weights_label(gguf: Path) -> str:
    from bench.peers.gguf_files import gguf_weights

    w = gguf_weights(gguf)
    return f"{w['label']}, {w['decode_bytes'] / 1e6:.0f} MB read / token"


def table_rows(result: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for cls, sides in result["classes"].items():
        for name, row in sides.items():
            rows.append([cls, name, row["tok_s"], row["tpot_p50_ms"], accept_cell(row),
                         _opt(row.get("vs_plain")), _opt(row.get("vs_llama")),
                         _opt(row.get("vs_llama-server ngram-simple")), _opt(row.get("vs_llama-server ngram-mod")),
                         "/".join(_opt(v) if v is None else f"{v:.2f}" for v in row.get("foreign_cores_rounds", []))
                         or "-"])
    return rows


TABLE_HEADER = ["class", "side", "tok/s", "TPOT p50 ms", "accept", "/ plain", "/ llama", "/ llama ngram-simple",
                "/ llama ngram-mod", "other procs (cores, per round)"]


def accept_cell(row: dict[str, Any]) -> str:
    """``rate (accepted/drafted)``; ``-`` for a side that does not speculate."""
    if row.get("drafted") is None:
        return "-"
    rate = "n/a" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
    return f"{rate} ({row['accepted']:.0f}/{row['drafted']:.0f})"


def _opt(v: Any) -> Any:
    return "-" if v is None else v


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from bench.peers.base import PeerUnavailable
    from bench.peers.llama_server import check_available, package_version
    from bench.report import print_table, write_results
    from engine.loader import default_gguf_path, resolve_model_dir

    p = argparse.ArgumentParser(prog="python -m bench.probes.spec_vs_llama_server", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="kvserve --num-threads and llama-server -t/-tb")
    p.add_argument("--methods", default="ngram", help="kvserve speculation methods, comma list of ngram,suffix")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--llama-ngram", default="simple,mod", help=f"llama-server n-gram sides: {', '.join(LLAMA_NGRAM)}")
    p.add_argument("--no-llama", action="store_true", help="kvserve sides only")
    p.add_argument("--tokens", type=int, default=128, help="max_tokens (with ignore_eos: the tokens of every request)")
    p.add_argument("--chat-prompts", type=int, default=3)
    p.add_argument("--classes", default=None, help="comma list of repeat-edit,quote,code-edit,chat (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)

    llama = not args.no_llama
    skipped = None
    if llama:
        try:
            check_available()
        except PeerUnavailable as exc:
            llama, skipped = False, str(exc)
            print(f"llama-server skipped: {skipped}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None)[0], local_files_only=True)
    prompts = prompt_ids(tokenizer, args.chat_prompts)
    if args.classes:
        prompts = {c: prompts[c] for c in args.classes.split(",")}
    methods = [m for m in args.methods.split(",") if m]
    sides = make_sides(methods, args.k, args.ngram_min, args.ngram_max,
                       [n for n in args.llama_ngram.split(",") if n], llama)
    gguf = Path(default_gguf_path())
    result = run_probe(sides, prompts, args.threads, args.tokens, args.rounds, gguf)
    result.update(weights=weights_label(gguf), llama_server_version=package_version() if llama else None,
                  llama_skipped=skipped, k=args.k, ngram=[args.ngram_min, args.ngram_max],
                  llama_ngram_flags={n: list(LLAMA_NGRAM[n]) for n in args.llama_ngram.split(",") if n})
    print_table(f"speculative decoding, single stream, greedy, {args.tokens} tokens (ignore_eos), k={args.k}, "
                f"median of {args.rounds} rounds; every side {args.threads} threads on {result['weights']}",
                table_rows(result), TABLE_HEADER)
    if llama:
        print(f"  llama-server: llama.cpp-tools {result['llama_server_version']}; n-gram flags: "
              + "; ".join(f"ngram-{n}: {' '.join(f)}" for n, f in result["llama_ngram_flags"].items()))
    idle = max((row["idle_sides_cores_max"] for c in result["classes"].values() for row in c.values()), default=0.0)
    print(f"  the idle sides' servers used at most {idle} cores while another side ran (counted in 'other procs')")
    m = result["machine"]
    print(f"  load average {m['loadavg_1m']} (1 min) / {m['loadavg_5m']} (5 min) on {m['cores']} cores at the end")
    for c in result["classes"].values():
        for row in c.values():
            row.pop("texts", None)
    print(f"  results: {write_results('spec_vs_llama_server', result, args.output)}")
    return result


if __name__ == "__main__":
    main()
