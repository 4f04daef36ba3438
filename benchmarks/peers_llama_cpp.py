"""The llama.cpp peer: llama-cpp-python in a worker process, or a llama.cpp binary.

The worker is this file run with `--llama-worker` (as `peers.py --llama-worker` also is) under
an interpreter that has `llama_cpp`: its own thread pool with no torch in the way, and the
qspec environment needs no build of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers_sample import Prompt, Sample


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


if __name__ == "__main__":
    llama_worker()
