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

llama.cpp runs in a worker process (this file, `--llama-worker`) under an interpreter that
has `llama_cpp` (`--llama-cpp-python`, default this one): its own thread pool with no torch
in the way, and the qspec environment needs no build of it. Or `--llama-cpp-bin` runs a
llama.cpp binary (llama-bench, or llama-cli / llama-completion) and reads its timings.

    python benchmarks/peers.py --context 2k,8k --gen 128 --repeats 3 --json peers.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "qspec_core" / "data"
PEER_FAMILIES = ("hf", "hf-lookup", "llama.cpp")
HF_DTYPES = ("bf16", "fp32")
WARMUP_PROMPT = 128  # tokens of the first prompt each peer runs once, untimed, before timing


def parse_size(text: str) -> int:
    """'2k' -> 2048, '8K' -> 8192, '1500' -> 1500."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


# ----------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    context: int  # requested context: prompt + generated tokens
    ids: list[int]
    text: str  # the rendered chat, for peers that take text
    sources: list[str]  # bundled texts in the document, in order (the last may be cut)
    cycled: bool  # the texts had to be repeated to reach the size


def build_prompt(tokenizer, n_tokens: int, context: int) -> Prompt:
    """A rendered document + summary-request chat of about `n_tokens` tokens (never more)."""
    from qspec_core.engine.session import SUMMARY_REQUEST, document_messages

    def render(document: str) -> tuple[str, list[int]]:
        messages = document_messages(document) + [{"role": "user", "content": SUMMARY_REQUEST}]
        text = tokenizer.render_chat(messages, True)
        return text, tokenizer.encode(text)

    overhead = len(render("")[1])
    texts = [(path.name, path.read_text()) for path in sorted(DATA.glob("*.txt"))]
    names, chunks, n_doc = [], [], 0
    while n_doc < n_tokens - overhead:  # different texts first; repeat only if they run out
        name, text = texts[len(names) % len(texts)]
        names.append(name)
        chunks.append(text.strip())
        n_doc = len(tokenizer.encode("\n\n".join(chunks)))
    doc_ids = tokenizer.encode("\n\n".join(chunks))
    budget = n_tokens - overhead
    for _ in range(8):  # decode/encode at the cut can merge or split a token: converge on it
        text, ids = render(tokenizer.decode(doc_ids[:budget]))
        if len(ids) <= n_tokens:
            break
        budget -= len(ids) - n_tokens
    return Prompt(context, ids, text, names, len(names) > len(texts))


# ----------------------------------------------------------------------------- samples


@dataclass
class Sample:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    first_tokens: int  # tokens that arrived with the first one (prompt lookup may accept more)
    decode_s: float  # from the first chunk to the last token
    tokens: list[int] = field(default_factory=list, repr=False)
    extra: dict = field(default_factory=dict)  # the peer's own timings, where it has them
    load_1m: float | None = None  # the machine's 1-minute load average after the run

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - self.first_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else math.nan


def spread(values: list[float]) -> dict:
    """Median, min and max, ignoring NaN (None where nothing is left: JSON has no NaN)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class _TokenClock:
    """A transformers streamer that only records when tokens arrive and how many.

    `generate` first puts the prompt, then each step's accepted tokens (one, or several with
    prompt lookup).
    """

    def __init__(self):
        self.events: list[tuple[float, int]] = []

    def put(self, value):
        self.events.append((time.perf_counter(), value.numel()))

    def end(self):
        pass


# ----------------------------------------------------------------------------- transformers


class HFPeer:
    """transformers `generate`, greedy; `lookup_tokens` turns on prompt-lookup decoding."""

    def __init__(self, model, dtype: str, lookup_tokens: int | None, cache: str):
        self.model = model
        self.dtype = dtype
        self.lookup_tokens = lookup_tokens
        self.family = "hf-lookup" if lookup_tokens else "hf"
        self.name = f"{self.family}-{dtype}"
        self.cache = cache

    @property
    def meta(self) -> dict:
        meta = {"backend": "transformers", "dtype": self.dtype, "cache": self.cache}
        if self.lookup_tokens:
            meta["prompt_lookup_num_tokens"] = self.lookup_tokens
        return meta

    def warmup(self, ids: list[int], notes: list[str]) -> None:
        """One short untimed run; a static cache that fails here falls back to dynamic."""
        try:
            self.run(ids, 4)
        except Exception as e:  # transformers raises many kinds; any of them means "not here"
            if self.cache != "static":
                raise
            self.cache = "dynamic"
            notes.append(f"{self.name}: static cache failed ({type(e).__name__}: {e}); dynamic")
            self.run(ids, 4)

    def run(self, ids: list[int], gen: int) -> Sample:
        import torch

        clock = _TokenClock()
        input_ids = torch.tensor([ids])
        kwargs = {
            "attention_mask": torch.ones_like(input_ids),
            "max_new_tokens": gen,
            "min_new_tokens": gen,
            "do_sample": False,
            "streamer": clock,
        }
        if self.lookup_tokens:
            kwargs["prompt_lookup_num_tokens"] = self.lookup_tokens
        if self.cache == "static" and self.lookup_tokens:
            from transformers import StaticCache

            # verification may run past the last kept token before cropping back: leave room.
            # Its buffers are allocated lazily, inside the timed call, as generate's own are.
            room = len(ids) + gen + self.lookup_tokens + 1
            kwargs["cache"] = StaticCache(config=self.model.config, max_cache_len=room)
        elif self.cache == "static":
            kwargs["cache_implementation"] = "static"
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids, **kwargs)
        new = out[0, len(ids) :].tolist()
        steps = clock.events[1:]  # [0] is the prompt
        t_first, first = steps[0]
        return Sample(len(ids), len(new), t_first - t0, first, steps[-1][0] - t_first, new)

    def close(self):
        pass


def load_hf_peers(folder: Path, families, dtypes, lookup_tokens, cache, notes) -> list[HFPeer]:
    try:
        import torch
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        notes.append(f"transformers peers skipped: {e}")
        return []
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    peers = []
    for dtype in dtypes:
        # one copy of the weights per dtype, shared by plain and prompt-lookup generate
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtypes[dtype]
        ).eval()
        if "hf" in families:
            peers.append(HFPeer(model, dtype, None, cache))
        if "hf-lookup" in families:
            peers.append(HFPeer(model, dtype, lookup_tokens, cache))
    return peers


# ----------------------------------------------------------------------------- qspec


class QspecPeer:
    """qspec's own `qspec bench` modes (`ar`, `quantspec`, ...) as rows of the same table,
    on the same token ids, interleaved with the peers: `qspec_core.bench.runner.run_once`."""

    family = "qspec"

    def __init__(self, runtime, mode: str, config):
        self.runtime, self.mode, self.config = runtime, mode, config
        self.name = f"qspec-{mode}"

    @property
    def meta(self) -> dict:
        from qspec_core.bench.runner import MODES

        return {"backend": "qspec", "dtype": "fp32", "cache": MODES[self.mode].cache}

    def warmup(self, ids: list[int], notes: list[str]) -> None:
        self.run(ids, 4)

    def run(self, ids: list[int], gen: int) -> Sample:
        from qspec_core.bench.runner import run_once

        r = run_once(self.runtime, self.mode, ids, gen, self.config, self.config.seed)
        extra = {"prefill_s": r.prefill_s, "stages_s": r.stages_s, "spec": r.spec}
        return Sample(r.prompt_tokens, r.new_tokens, r.ttft_s, 1, r.decode_s, r.tokens, extra)

    def close(self):
        pass


def load_qspec_peers(model: str | None, modes: tuple[str, ...], gen: int, notes) -> list:
    from qspec_core.bench.runner import MODES, BenchConfig, needs_converted_model
    from qspec_core.registry.runtime import load_runtime

    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--qspec-modes: unknown {unknown} (have: {', '.join(MODES)})")
    config = BenchConfig(contexts=[], gen=gen, modes=modes)
    need = needs_converted_model(config)
    runtime = load_runtime(model, dtype="fp32", log=lambda m: None, need_draft=need)
    notes.append(f"qspec modes {', '.join(modes)}: fp32, greedy, gamma {config.gamma}")
    return [QspecPeer(runtime, m, config) for m in modes]


# ----------------------------------------------------------------------------- llama.cpp


class LlamaCppPeer:
    """llama-cpp-python in a worker process, driven one run at a time over pipes."""

    family = "llama.cpp"

    def __init__(self, python: str, gguf: Path, n_ctx: int, threads: int, flash_attn: bool):
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--llama-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        load = {"gguf": str(gguf), "n_ctx": n_ctx, "threads": threads, "flash_attn": flash_attn}
        try:
            self.info = self._call({"cmd": "load", **load})
        except RuntimeError:
            self.close()
            raise
        self.name = f"llama.cpp-{self.info['weights'].lower()}"

    @property
    def meta(self) -> dict:
        keys = ("weights", "kv", "n_ctx", "n_batch", "n_ubatch", "flash_attn", "threads")
        return {"backend": "llama-cpp-python", "dtype": self.info["weights"], "cache": "f16 KV"} | {
            k: self.info[k] for k in keys
        }

    def _call(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (code {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def tokenize(self, text: str) -> list[int]:
        return self._call({"cmd": "tokenize", "text": text})["ids"]

    def warmup(self, ids: list[int], notes: list[str]) -> None:
        self.run(ids, 4)

    def run(self, ids: list[int], gen: int) -> Sample:
        r = self._call({"cmd": "run", "ids": ids, "gen": gen})
        return Sample(
            len(ids), len(r["tokens"]), r["ttft_s"], 1, r["decode_s"], r["tokens"], r["perf"]
        )

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def llama_worker() -> None:
    """Serve load/tokenize/run requests, one JSON object a line on stdin, replies on stdout."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the C library prints goes to stderr, not into the protocol
    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["cmd"] == "load":
                llm, reply = _worker_load(request)
            elif request["cmd"] == "tokenize":
                reply = {"ids": llm.tokenize(request["text"].encode(), add_bos=False, special=True)}
            else:
                reply = _worker_run(llm, request["ids"], request["gen"])
        except Exception as e:  # report to the parent, which decides what to skip
            reply = {"error": f"{type(e).__name__}: {e}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


def _worker_load(request: dict):
    import llama_cpp

    llm = llama_cpp.Llama(
        request["gguf"],
        n_ctx=request["n_ctx"],
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        flash_attn=request["flash_attn"],
        verbose=False,
    )  # KV type left at llama.cpp's default, f16
    desc = llm._model.desc() if hasattr(llm._model, "desc") else ""
    quant = re.search(r"\b(Q\d\w*|F16|BF16|F32)\b", desc, re.I)
    info = {
        "llama_cpp": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "model_desc": desc,
        "weights": quant.group(1).upper() if quant else "gguf",
        "kv": "f16",
        "n_ctx": llm.n_ctx(),
        "n_batch": llm.n_batch,
        "n_ubatch": llm.context_params.n_ubatch,
        "flash_attn": request["flash_attn"],
        "threads": request["threads"],
    }
    return llm, info


def _worker_run(llm, ids: list[int], gen: int) -> dict:
    import llama_cpp

    llm.reset()  # no prefix reuse between runs: every run prefills the whole prompt
    llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    tokens, times = [], []
    t0 = time.perf_counter()
    # generate() yields each sampled token before evaluating it, so stopping at `gen` skips
    # the pass over the last one, as transformers does
    greedy = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    for token in llm.generate(ids, reset=True, **greedy):
        times.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == gen:
            break
    perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
    return {
        "tokens": tokens,
        "ttft_s": times[0] - t0,
        "decode_s": times[-1] - times[0],
        "perf": {  # llama.cpp's own clocks: prompt batches, then single-token evals
            "prompt_eval_ms": perf.t_p_eval_ms,
            "prompt_eval_tokens": perf.n_p_eval,
            "eval_ms": perf.t_eval_ms,
            "eval_tokens": perf.n_eval,
        },
    }


class LlamaBinPeer:
    """A llama.cpp binary: llama-bench (`-p`/`-n`/`-d`), or llama-cli/llama-completion."""

    family = "llama.cpp"

    def __init__(self, binary: Path, gguf: Path, n_ctx: int, threads: int, flash_attn: bool):
        self.binary, self.gguf, self.n_ctx = binary, gguf, n_ctx
        self.threads, self.flash_attn = threads, flash_attn
        self.bench = "bench" in binary.name
        self.name = f"llama.cpp-bin-{'bench' if self.bench else 'cli'}"
        self.prompt_text: dict[int, str] = {}  # len(ids) -> rendered text, set by the caller

    @property
    def meta(self) -> dict:
        return {
            "backend": str(self.binary),
            "dtype": self.gguf.name,
            "cache": "f16 KV",
            "n_ctx": self.n_ctx,
            "flash_attn": self.flash_attn,
            "threads": self.threads,
        }

    def warmup(self, ids: list[int], notes: list[str]) -> None:
        self.run(ids, 4)

    def _common(self) -> list[str]:
        if self.bench:
            fa = ["-fa", "1" if self.flash_attn else "0"]
        else:  # llama-cli and llama-completion take on/off/auto
            fa = ["-fa", "on" if self.flash_attn else "off"]
        return ["-m", str(self.gguf), "-t", str(self.threads), "-ctk", "f16", "-ctv", "f16", *fa]

    def run(self, ids: list[int], gen: int) -> Sample:
        return self._run_bench(ids, gen) if self.bench else self._run_cli(ids, gen)

    def _run_bench(self, ids: list[int], gen: int) -> Sample:
        """llama-bench times synthetic tokens; the decode test runs at the prompt's depth."""

        def rate(*args: str) -> float:
            cmd = [str(self.binary), *self._common(), "-r", "1", "-o", "json", *args]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            return json.loads(proc.stdout)[0]["avg_ts"]

        prefill = rate("-p", str(len(ids)), "-n", "0")
        decode = rate("-p", "0", "-n", str(gen - 1), "-d", str(len(ids)))
        bench = {"prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode}
        return Sample(len(ids), gen, len(ids) / prefill, 1, (gen - 1) / decode, [], bench)

    def _run_cli(self, ids: list[int], gen: int) -> Sample:
        """Prompt as text; timings from llama.cpp's `llama_perf_context_print` lines."""
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(self.prompt_text[len(ids)])
            f.flush()
            cmd = [str(self.binary), *self._common(), "-f", f.name, "-n", str(gen)]
            cmd += ["-c", str(self.n_ctx), "--temp", "0", "--ignore-eos", "-no-cnv"]
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        log = proc.stderr + proc.stdout
        prompt = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
        decode = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
        if proc.returncode != 0 or not prompt or not decode:
            raise RuntimeError(f"{self.binary.name} gave no timings: {log.strip()[-300:]}")
        n_prompt, n_eval = int(prompt.group(2)), int(decode.group(2))
        ttft = float(prompt.group(1)) / 1e3
        timings = {"prompt_eval_tokens": n_prompt, "eval_tokens": n_eval}
        return Sample(n_prompt, n_eval + 1, ttft, 1, float(decode.group(1)) / 1e3, [], timings)

    def close(self):
        pass


def start_llama_peer(args: dict, prompts: list[Prompt], tokenizer, notes: list[str]):
    """The llama.cpp peer, or None with a note saying why not."""
    gguf, threads, fa = args["gguf"], args["threads"], args["flash_attn"]
    n_ctx = max(p.context for p in prompts)
    if gguf is None:
        notes.append("llama.cpp skipped: no GGUF for this model (pass --gguf)")
        return None
    if args["bin"] is not None:
        peer = LlamaBinPeer(Path(args["bin"]), gguf, n_ctx, threads, fa)
        peer.prompt_text = {len(p.ids): p.text for p in prompts}
        notes.append(f"llama.cpp through the binary {args['bin']}")
        return peer
    python = args["python"] or sys.executable
    if args["python"] is None and importlib.util.find_spec("llama_cpp") is None:
        notes.append(
            "llama.cpp skipped: llama_cpp is not importable here; install llama-cpp-python, "
            "or pass --llama-cpp-python PY (an interpreter that has it) or --llama-cpp-bin"
        )
        return None
    try:
        peer = LlamaCppPeer(python, gguf, n_ctx, threads, fa)
    except (RuntimeError, OSError) as e:
        notes.append(f"llama.cpp skipped: worker under {python} failed ({e})")
        return None
    probe = prompts[0].text[:4000]
    theirs, ours = peer.tokenize(probe), tokenizer.encode(probe)
    peer.info["tokenizer_matches_hf"] = theirs == ours
    if theirs != ours:  # harmless here: every peer is given the same token ids, not text
        notes.append(
            f"llama.cpp's tokenizer splits a {len(probe)}-character probe into {len(theirs)} "
            f"tokens, the HF tokenizer into {len(ours)}; all peers get the HF token ids"
        )
    return peer


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


def _row(peer, prompt: Prompt, samples: list[Sample]) -> dict:
    return {
        "peer": peer.name,
        "family": peer.family,
        **peer.meta,
        "context": prompt.context,
        "prompt_tokens": samples[0].prompt_tokens,
        "new_tokens": samples[0].new_tokens,
        "runs": len(samples),
        "ttft_s": spread([s.ttft_s for s in samples]),
        "prefill_tokens_per_s": spread([s.prefill_tokens_per_s for s in samples]),
        "decode_tokens_per_s": spread([s.decode_tokens_per_s for s in samples]),
        "ms_per_token": spread([1e3 / s.decode_tokens_per_s for s in samples]),
        "tokens": samples[0].tokens,
        "samples": [
            {k: v for k, v in asdict(s).items() if k != "tokens"} | {"total_s": s.total_s}
            for s in samples
        ],
    }


def _agreement(rows: list[dict]) -> None:
    """Mark each row with how many leading tokens match hf-fp32's (else the first row's)."""
    from qspec_core.engine.session import common_prefix

    for context in {r["context"] for r in rows}:
        same = [r for r in rows if r["context"] == context]
        ref = next((r for r in same if r["peer"] == "hf-fp32"), same[0])
        for r in same:
            n = common_prefix(r["tokens"], ref["tokens"])
            r["agree_with"] = ref["peer"] if r["tokens"] else None
            r["agree_tokens"] = n if r["tokens"] else None


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
    log=print,
) -> dict:
    """Time the peers on qspec-style prompts; returns settings, machine, notes and rows.

    `context_sizes` are prompt + `gen` tokens. A peer whose run exceeds `budget_s`, or whose
    time scaled linearly by prompt length predicts that, is skipped for that size and larger.
    """
    import torch

    from qspec_core.registry.sources import DEFAULT_MODEL, _registry_gguf, resolve_model
    from qspec_core.model.tokenizer import Tokenizer

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

    runners = load_qspec_peers(model, qspec_modes, gen, notes) if qspec_modes else []
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
        rows += [_row(p, prompt, samples[p.name]) for p in runners if samples[p.name]]
    for peer in runners:
        peer.close()
    _agreement(rows)

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


# ----------------------------------------------------------------------------- output


def _cell(stats: dict, fmt: str) -> str:
    if stats["median"] is None:
        return "-"
    text = format(stats["median"], fmt)
    if stats["min"] != stats["max"]:
        text += f" ({format(stats['min'], fmt)}-{format(stats['max'], fmt)})"
    return text


def render_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    m = result["machine"]
    title = f"Peers: {m['cpu']}, {m['threads']} threads, {result['settings']['gen']} new tokens"
    table = Table(title=title, caption="median (min-max) over runs")
    for name in ("peer", "cache", "context", "prompt tok", "TTFT s", "prefill tok/s"):
        table.add_column(name, justify="left" if name in ("peer", "cache") else "right")
    for name in ("decode tok/s", "ms/token", "runs", "agree"):
        table.add_column(name, justify="right")
    for r in result["results"]:
        agree = "" if r["agree_tokens"] is None else f"{r['agree_tokens']}/{len(r['tokens'])}"
        table.add_row(
            r["peer"],
            r["cache"],
            str(r["context"]),
            str(r["prompt_tokens"]),
            _cell(r["ttft_s"], ".2f"),
            _cell(r["prefill_tokens_per_s"], ".0f"),
            _cell(r["decode_tokens_per_s"], ".1f"),
            _cell(r["ms_per_token"], ".1f"),
            str(r["runs"]),
            agree,
        )
    console = Console(width=None if sys.stdout.isatty() else 160)  # whole cells in logs too
    console.print(table)
    for note in result["notes"]:
        console.print(f"note: {note}")


def main():
    if "--llama-worker" in sys.argv[1:]:
        llama_worker()
        return
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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    families = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    unknown = set(families) - set(PEER_FAMILIES)
    if unknown:
        ap.error(f"unknown peers {sorted(unknown)}; choose from {', '.join(PEER_FAMILIES)}")
    result = run_peers(
        [parse_size(s) for s in args.context.split(",")],
        gen=args.gen,
        repeats=args.repeats,
        peers=families,
        hf_dtypes=tuple(d.strip() for d in args.hf_dtypes.split(",") if d.strip()),
        threads=args.threads,
        model=args.model,
        gguf=args.gguf,
        llama_cpp_python=args.llama_cpp_python,
        llama_cpp_bin=args.llama_cpp_bin,
        llama_flash_attn=args.llama_flash_attn,
        lookup_tokens=args.lookup_tokens,
        hf_cache=args.hf_cache,
        budget_s=args.budget_s,
        qspec_modes=tuple(m.strip() for m in args.qspec_modes.split(",") if m.strip()),
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    render_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
