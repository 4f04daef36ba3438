"""Peers on qspec's prompts: transformers `generate` (plain and prompt lookup) and llama.cpp.

qspec's own modes (`--qspec-modes`, default ar,quantspec) run as rows of the same table, on
the same token ids, interleaved with the peers. Each context size gets one prompt: bundled
real texts framed the way qspec frames a document (a system message holding it, then the
summary request), rendered with the model's chat template and cut so that prompt + generated
tokens fill the context. Peers run interleaved (A B C A B C ...) so machine drift hits all
alike; tables give medians and min-max.

Per run: TTFT = from the call until the first new token exists (prefill, first sampling and
whatever setup the peer does per call); prefill tok/s = prompt tokens / TTFT; decode = the
tokens after the first chunk over the time after it (prompt lookup may emit several at once).
Greedy everywhere; transformers is held to exactly `--gen` new tokens (EOS masked), llama.cpp
keeps going past EOS, so all peers do the same amount of work.

llama.cpp runs in a worker process (peers_llama_cpp.py, or this file with `--llama-worker`)
under an interpreter that has `llama_cpp` (`--llama-cpp-python`, default this one): its own
thread pool with no torch in the way, and the qspec environment needs no build of it.
Or `--llama-cpp-bin` runs a llama.cpp binary (llama-bench, or llama-cli / llama-completion)
and reads its timings.

    python benchmarks/peers.py --context 2k,8k --gen 128 --repeats 3 --json peers.json

The parts: peers_sample.py (the prompt and a run's Sample), peers_torch.py (transformers and
qspec peers), peers_llama_cpp.py (the llama.cpp peer and its worker), peers_report.py (rows,
agreement, the table); this file times them and is the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

# the peers_* modules beside this one, also when this file is loaded by path (tests)
sys.path.append(str(Path(__file__).resolve().parent))

from peers_llama_cpp import LlamaCppPeer, llama_worker, start_llama_peer
from peers_report import mark_agreement, render_table, result_row
from peers_sample import Sample, build_prompt
from peers_torch import load_hf_peers, load_qspec_peers

PEER_FAMILIES = ("hf", "hf-lookup", "llama.cpp")
HF_DTYPES = ("bf16", "fp32")
WARMUP_PROMPT = 128  # tokens of the first prompt each peer runs once, untimed, before timing


def parse_size(text: str) -> int:
    """'2k' -> 2048, '8K' -> 8192, '1500' -> 1500."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


# ----------------------------------------------------------------------------- runs


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for module in ("torch", "transformers"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    return info


def run_peers(
    context_sizes: list[int],
    gen: int = 128,
    repeats: int = 3,
    peers: tuple[str, ...] = PEER_FAMILIES,
    hf_dtypes: tuple[str, ...] = HF_DTYPES,
    threads: int | None = None,
    model: str | None = None,
    gguf: Path | None = None,
    llama_cpp_python: str | None = None,
    llama_cpp_bin: Path | None = None,
    llama_flash_attn: bool = False,
    lookup_tokens: int = 10,
    hf_cache: str = "static",
    budget_s: float = 600.0,
    qspec_modes: tuple[str, ...] = (),
    target_weights: str = "auto",
    log=print,
) -> dict:
    """Time the peers on qspec-style prompts; returns settings, machine, notes and rows.

    `context_sizes` are prompt + `gen` tokens. A peer whose run exceeds `budget_s`, or whose
    time scaled linearly by prompt length predicts that, is skipped for that size and larger.
    """
    import torch

    from qspec_core.model.tokenizer import Tokenizer
    from qspec_core.registry.sources import DEFAULT_MODEL, _registry_gguf, resolve_model

    threads = threads or os.cpu_count()
    torch.set_num_threads(threads)
    notes: list[str] = []
    load_start = os.getloadavg()
    folder = resolve_model(model, log)
    tokenizer = Tokenizer(folder)
    limit = json.loads((folder / "config.json").read_text()).get("max_position_embeddings")
    prompts = []
    for context in sorted(context_sizes):
        if limit and context > limit:
            notes.append(f"context {context} exceeds the model's {limit}: skipped")
            continue
        prompt = build_prompt(tokenizer, context - gen, context)
        if prompt.cycled:
            notes.append(f"context {context}: the bundled texts were repeated to fill it")
        prompts.append(prompt)
    if model is None and gguf is None:
        gguf = _registry_gguf(DEFAULT_MODEL, log)

    runners = []
    if qspec_modes:
        runners = load_qspec_peers(model, qspec_modes, gen, notes, target_weights)
    runners += load_hf_peers(folder, peers, hf_dtypes, lookup_tokens, hf_cache, notes)
    if "llama.cpp" in peers and prompts:
        llama_args = {"gguf": gguf, "threads": threads, "flash_attn": llama_flash_attn}
        llama_args |= {"python": llama_cpp_python, "bin": llama_cpp_bin}
        llama_peer = start_llama_peer(llama_args, prompts, tokenizer, notes)
        if llama_peer is not None:
            runners.append(llama_peer)
    warmup_ids = prompts[0].ids[:WARMUP_PROMPT] if prompts else []
    for peer in list(runners):
        try:
            peer.warmup(warmup_ids, notes)
        except Exception as e:  # a peer that cannot run here is a note, not a crash
            notes.append(f"{peer.name} skipped: warmup failed ({type(e).__name__}: {e})")
            peer.close()
            runners.remove(peer)

    rows, last_cost, stopped = [], {}, set()
    for prompt in prompts:
        samples: dict[str, list[Sample]] = {p.name: [] for p in runners}
        log(f"context {prompt.context}: prompt {len(prompt.ids)} tokens, {gen} new")
        for _ in range(repeats):
            for peer in runners:
                if peer.name in stopped:
                    continue
                if peer.name in last_cost:
                    n0, s0 = last_cost[peer.name]
                    predicted = s0 * len(prompt.ids) / n0
                    if predicted > budget_s:
                        stopped.add(peer.name)
                        notes.append(
                            f"{peer.name} stopped before context {prompt.context}: its last run "
                            f"took {s0:.0f} s, this one would take ~{predicted:.0f} s "
                            f"> --budget-s {budget_s:.0f}"
                        )
                        continue
                try:
                    sample = peer.run(prompt.ids, gen)
                except Exception as e:  # one peer failing must not lose the others' runs
                    stopped.add(peer.name)
                    notes.append(f"{peer.name} stopped at context {prompt.context}: {e!r}")
                    continue
                sample.load_1m = os.getloadavg()[0]  # other work on the machine skews runs
                samples[peer.name].append(sample)
                last_cost[peer.name] = (len(prompt.ids), sample.total_s)
                log(
                    f"  {peer.name:18s} TTFT {sample.ttft_s:7.2f} s  prefill "
                    f"{sample.prefill_tokens_per_s:8.1f} tok/s  decode "
                    f"{sample.decode_tokens_per_s:7.2f} tok/s  load {sample.load_1m:.1f}"
                )
        rows += [result_row(p, prompt, samples[p.name]) for p in runners if samples[p.name]]
    for peer in runners:
        peer.close()
    mark_agreement(rows)

    machine = machine_info(threads)
    machine["loadavg_start"], machine["loadavg_end"] = load_start, os.getloadavg()
    busiest = max([load_start[0]] + [s["load_1m"] for r in rows for s in r["samples"]])
    if busiest > (os.cpu_count() or 1) + 0.5:  # our own threads alone make it ~cpu_count
        notes.append(
            f"the machine was busy (load average up to {busiest:.1f} on {os.cpu_count()} CPUs): "
            "threads that wait for a descheduled sibling at every op dominate multi-threaded "
            "runs; rerun on an idle machine, or compare with --threads 1"
        )
    llama = next((p for p in runners if isinstance(p, LlamaCppPeer)), None)
    machine["llama_cpp"] = llama.info["llama_cpp"] if llama else None
    if llama:
        machine["llama_cpp_system_info"] = llama.info["system_info"]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "settings": {
            "model": folder.name,  # names, not paths: results get shared and committed
            "gguf": gguf.name if gguf else None,
            "gen": gen,
            "repeats": repeats,
            "hf_cache_requested": hf_cache,
            "prompt_lookup_num_tokens": lookup_tokens,
            "budget_s": budget_s,
            "prompts": [
                {"context": p.context, "prompt_tokens": len(p.ids), "sources": p.sources}
                for p in prompts
            ],
        },
        "notes": notes,
        "results": rows,
    }


def main():
    if "--llama-worker" in sys.argv[1:]:
        llama_worker()
        return
    from qspec_core.registry.runtime import TARGET_WEIGHTS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", default="2k,8k", help="context sizes (prompt + new tokens)")
    ap.add_argument("--gen", type=int, default=128, help="new tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEER_FAMILIES))
    ap.add_argument("--hf-dtypes", default=",".join(HF_DTYPES), help="bf16, fp32, fp16")
    ap.add_argument("--hf-cache", choices=("static", "dynamic"), default="static")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    ap.add_argument("--threads", type=int, help="torch and llama.cpp threads (default: all)")
    ap.add_argument("--model", help="HF folder, GGUF or hub id (default: qspec's default)")
    ap.add_argument("--gguf", type=Path, help="GGUF for llama.cpp (default model: its Q4_1)")
    ap.add_argument("--llama-cpp-python", help="interpreter with llama_cpp (default: this one)")
    ap.add_argument("--llama-cpp-bin", type=Path, help="llama-bench or llama-cli binary")
    ap.add_argument("--llama-flash-attn", action="store_true")
    ap.add_argument("--budget-s", type=float, default=600.0, help="longest run a peer may take")
    ap.add_argument(
        "--qspec-modes",
        default="ar,quantspec",
        help="qspec bench modes to run as rows of the same table ('' for none)",
    )
    ap.add_argument(
        "--target-weights",
        default="auto",
        choices=TARGET_WEIGHTS,
        help="qspec's target weights, as qspec bench's option (auto: w8a8 on a CPU)",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    families = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    unknown = set(families) - set(PEER_FAMILIES)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEER_FAMILIES)}")
    # the options run_peers takes as they come (the others are parsed first)
    as_given = "gen repeats threads model gguf llama_cpp_python llama_cpp_bin llama_flash_attn"
    as_given += " lookup_tokens hf_cache budget_s target_weights"
    result = run_peers(
        [parse_size(s) for s in args.context.split(",")],
        peers=families,
        hf_dtypes=tuple(d.strip() for d in args.hf_dtypes.split(",") if d.strip()),
        qspec_modes=tuple(m.strip() for m in args.qspec_modes.split(",") if m.strip()),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        **{name: getattr(args, name) for name in as_given.split()},
    )
    render_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
