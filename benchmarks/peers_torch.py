"""The peers that run in this process on torch: transformers `generate` (plain and prompt
lookup) and qspec's own `qspec bench` modes."""

from __future__ import annotations

import time
from pathlib import Path

from peers_sample import Sample


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
    """The transformers peers `families` asks for, one model per dtype; none (and no model
    read: an 8B fp32 copy alone is 32 GB) when it asks for neither "hf" nor "hf-lookup"."""
    if not {"hf", "hf-lookup"} & set(families):
        return []
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

        cache = "fp" if MODES[self.mode].target.kv == "fp" else "hier"  # the cache follows its KV
        return {"backend": "qspec", "dtype": "fp32", "cache": cache}

    def warmup(self, ids: list[int], notes: list[str]) -> None:
        self.run(ids, 4)

    def run(self, ids: list[int], gen: int) -> Sample:
        from qspec_core.bench.runner import run_once

        r = run_once(self.runtime, self.mode, ids, gen, self.config, self.config.seed)
        extra = {"prefill_s": r.prefill_s, "stages_s": r.stages_s, "spec": r.spec}
        return Sample(r.prompt_tokens, r.new_tokens, r.ttft_s, 1, r.decode_s, r.tokens, extra)

    def close(self):
        pass


def load_qspec_peers(
    model: str | None, modes: tuple[str, ...], gen: int, notes, target_weights: str = "auto"
) -> list:
    from qspec_core.bench.runner import (
        MODES,
        BenchConfig,
        needs_converted_model,
        needs_full_weights,
    )
    from qspec_core.registry.runtime import prepare_and_load, wanted_target_weights

    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--qspec-modes: unknown {unknown} (have: {', '.join(MODES)})")
    wanted = wanted_target_weights(target_weights, "cpu")
    config = BenchConfig(contexts=[], gen=gen, modes=modes, target_weights=wanted)
    need = needs_converted_model(config)
    runtime = prepare_and_load(
        model,
        dtype="fp32",
        log=lambda m: None,
        need_draft=need,
        target_weights="auto" if need and target_weights == "auto" else "full",
        full_weights=needs_full_weights(config),
    )
    if target_weights == "auto":
        config.target_weights = runtime.target_weights
    notes.append(
        f"qspec modes {', '.join(modes)}: fp32, greedy, gamma {config.gamma}, target weights "
        f"{config.target_weights}"
    )
    return [QspecPeer(runtime, m, config) for m in modes]
