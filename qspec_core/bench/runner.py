"""`qspec bench`: QuantSpec against its baselines and ablations, side by side, in one run.

Every (context, mode) is run `repeats` times, interleaved (A B C A B C ...) so that drift on a
shared machine hits every mode alike; the report gives medians with min-max, and each mode's
speedup over `ar` is computed pair-wise within a repeat (same minute, same machine state)
before taking the median. A context size N means N tokens in the cache at the end: a prompt of
N - gen tokens (real text, see `corpus.py`) followed by `gen` decoded tokens. Stop tokens are
ignored so every mode decodes exactly `gen` tokens.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from qspec_core.bench.bandwidth import (
    kv_read_positions,
    path_weight_bytes,
    read_bandwidth,
    step_traffic,
)
from qspec_core.bench.compute import gemm_peaks, prefill_compute, prefill_flops
from qspec_core.bench.corpus import bench_prompt
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.draft_vocab import head_rows
from qspec_core.engine.generate import linear_clock, prefill, prefill_hierarchical
from qspec_core.engine.plan import DecodePlan
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats
from qspec_core.errors import QspecError
from qspec_core.model.transformer import has_draft, has_int8
from qspec_core.precision import DRAFT, DRAFT_KV4, DRAFT_W4, FP, INT8_WEIGHTS, TARGET, Precision
from qspec_core.registry.runtime import Runtime
from qspec_core.runner.layouts import WeightLayouts
from qspec_core.runner.prefill_choice import prefill_path
from qspec_core.timing import StageTimer, peak_rss_bytes


@dataclass(frozen=True)
class Mode:
    """How one bench mode decodes: the path that decodes (AR) or verifies, and the draft's.
    The cache follows the target's KV view: "fp" a FullPrecisionCache, else hierarchical."""

    name: str
    target: Precision
    draft: Precision | None  # None: autoregressive
    about: str
    weights: str | None = None  # target weights: None follows --target-weights; else forced
    lookup: bool | None = None  # drafts from the prompt too: None follows --lookup
    gamma: int | None = None  # None follows --gamma
    trees: bool = True  # with --gamma auto and the lookup: the document's token trees too

    @property
    def speculative(self) -> bool:
        return self.draft is not None


MODES = {
    m.name: m
    for m in (
        Mode("ar", FP, None, "autoregressive, target weights, full-precision KV (baseline)"),
        Mode("target-ar", TARGET, None, "autoregressive, target weights, INT8 KV"),
        Mode("quantspec", TARGET, DRAFT, "draft 4-bit weights + INT4 KV; verify INT8"),
        Mode("quantspec-g4", TARGET, DRAFT, "the earlier recipe: 4 drafts a round, all 4-bit",
             lookup=False, gamma=4),
        # (opt-in: quantspec without token trees, beside it in the same run)
        Mode("quantspec-chain", TARGET, DRAFT, "quantspec with one chain a round, no trees",
             trees=False),
        Mode("draft-w4", FP, DRAFT_W4, "ablation: draft 4-bit weights, full KV"),
        Mode("draft-kv4", TARGET, DRAFT_KV4, "ablation: draft full weights, INT4 KV"),
        Mode("ar-w8", FP, None, "autoregressive, INT8 weights, full KV", "int8"),
        Mode(
            "quantspec-w8verify",
            TARGET,
            DRAFT,
            "quantspec verifying with INT8 weights (Quasar)",
            "int8",
        ),
        # (opt-in: the checkpoint's weights beside a W8A8 default, in the same run)
        Mode("target-ar-full", TARGET, None, "autoregressive, the checkpoint's weights, INT8 KV",
             "full"),
        Mode("quantspec-full", TARGET, DRAFT, "quantspec verifying on the checkpoint's weights",
             "full"),
    )
}  # fmt: skip
DEFAULT_MODES = tuple(m for m in MODES if not m.endswith(("-full", "-chain")))
SPEC_STAGES = ("lookup", "tree", "draft", "verify", "accept", "rollback", "rotate")
WARMUP_TOKENS = 8


def comma_items(text: str, option: str, example: str) -> list[str]:
    """The stripped items of a comma-separated option. An empty one (`2k,`, `2k,,8k`) is
    refused, not dropped: a typo would otherwise run a different bench than the one asked."""
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        raise QspecError(f"{option} needs at least one value, e.g. {example}")
    if "" in items:
        raise QspecError(f"{option} {text!r} has an empty item, a comma too many? (e.g. {example})")
    return items


def parse_contexts(text: str) -> list[int]:
    """'2k,8k,32k' -> [2048, 8192, 32768]; plain numbers are token counts."""
    sizes = []
    for part in comma_items(text, "--context", "2k,8k"):
        part = part.lower()
        scale = 1024 if part.endswith("k") else 1
        number = part[:-1] if part.endswith("k") else part
        try:
            value = float(number) * scale
        except ValueError:
            raise QspecError(
                f"--context: {part!r} is not a size (use numbers with an optional k: 2k,8k)"
            ) from None
        if value <= 0 or value != int(value):
            raise QspecError(f"--context: {part!r} is not a whole positive number of tokens")
        sizes.append(int(value))
    return sizes


def size_label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def parse_modes(text: str | None) -> tuple[str, ...]:
    if text is None:
        return DEFAULT_MODES
    modes = tuple(dict.fromkeys(comma_items(text, "--modes", "ar,quantspec")))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise QspecError(f"--modes: unknown {', '.join(unknown)} (have: {', '.join(MODES)})")
    return modes


@dataclass
class BenchConfig:
    contexts: list[int]
    gen: int = 128
    modes: tuple[str, ...] = DEFAULT_MODES
    repeats: int = 3
    gamma: int | str = "auto"
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    group_size: int | None = None
    warmup: bool = True
    target_weights: str = "full"  # of the modes that do not force theirs
    lookup: bool = True  # speculative modes also draft from the prompt (`engine/lookup.py`)

    def weights(self, mode: str) -> str:
        return MODES[mode].weights or self.target_weights

    def gamma_of(self, mode: str) -> int | str:
        return MODES[mode].gamma or self.gamma

    def target(self, mode: str) -> Precision:
        """The mode's decoding/verifying path on its target weights."""
        return MODES[mode].target.with_weights(self.weights(mode))

    def plan(self, mode_name: str) -> DecodePlan:
        """How `mode_name` decodes under these settings."""
        mode, target = MODES[mode_name], self.target(mode_name)
        if not mode.speculative:
            return DecodePlan(target)
        # a draft on full weights (the draft-kv4 ablation) takes the target's weight set
        draft = (
            mode.draft if mode.draft.weights == "int4" else mode.draft.with_weights(target.weights)
        )
        lookup = self.lookup if mode.lookup is None else mode.lookup
        return DecodePlan(target, draft, self.gamma_of(mode_name), lookup, trees=mode.trees)


def needs_converted_model(config: BenchConfig) -> bool:
    """Whether a mode runs the 4-bit draft weights or INT8 weights: only a converted folder
    has them (a named model's is made once, on first need)."""
    return any(
        (MODES[m].draft or FP).weights == "int4" or config.weights(m) in INT8_WEIGHTS
        for m in config.modes
    )


def needs_full_weights(config: BenchConfig) -> bool:
    """Whether a mode runs the checkpoint's own weights (a target on "full", or a draft on
    them, as draft-kv4's): else the runtime need not read them (`load_runtime`'s
    `full_weights`), and an 8B model's bench holds its INT8 and 4-bit weights only."""
    drafts = [MODES[m].draft for m in config.modes if MODES[m].draft is not None]
    return any(config.weights(m) == "full" for m in config.modes) or any(
        d.weights == "full" for d in drafts
    )


def check_config(config: BenchConfig, runtime: Runtime) -> None:
    """Refuse what cannot run, before any work: sizes beyond the model, no draft, no room."""
    limit = runtime.context_limit
    too_long = [c for c in config.contexts if c > limit]
    if too_long:
        raise QspecError(
            f"--context {', '.join(map(str, too_long))} is beyond {runtime.name}'s context of "
            f"{limit} tokens. Use sizes up to {limit} (e.g. --context {limit // 1024}k), or a "
            "long-context model: --model qwen2.5-coder-0.5b (32k, opt-in download)"
        )
    short = [c for c in config.contexts if c - config.gen < 64]
    if short:
        raise QspecError(
            f"--context {short[0]} leaves fewer than 64 prompt tokens before --gen "
            f"{config.gen} new ones; use a larger context or a smaller --gen"
        )
    if config.repeats < 1 or config.gen < 2:
        raise QspecError("--repeats must be >= 1 and --gen >= 2")
    needs_int8 = [m for m in config.modes if config.weights(m) in INT8_WEIGHTS]
    if needs_int8 and not has_int8(runtime.model):
        raise QspecError(
            f"modes {', '.join(needs_int8)} need INT8 verifier weights and {runtime.name} has "
            "none: convert it with qspec convert (which writes them), then --model DIR"
        )
    needs_w8a8 = [m for m in config.modes if config.weights(m) == "w8a8"]
    if needs_w8a8 and "w8a8" not in runtime.model.weight_sets:
        raise QspecError(
            f"modes {', '.join(needs_w8a8)} run W8A8, which needs every linear layer's inputs "
            f"in whole 64-input chunks; {runtime.name} has others: --target-weights int8 or full"
        )
    needs_draft = [m for m in config.modes if (MODES[m].draft or FP).weights == "int4"]
    if needs_draft and not has_draft(runtime.model):
        raise QspecError(
            f"modes {', '.join(needs_draft)} need 4-bit draft weights and {runtime.name} has "
            "none: convert it first (qspec convert MODEL -o DIR, then --model DIR)"
        )


@dataclass
class Run:
    """One mode at one context, one repeat."""

    mode: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    ttft_s: float  # start (cache allocation) to the first token
    decode_s: float  # first token to the last
    stages_s: dict[str, float]
    spec: dict | None
    kv_bytes_per_token: dict[str, float]
    kv_cache_bytes: int  # what the cache holds at the end (valid data)
    peak_memory_bytes: int | None  # CUDA peak for this run; None on CPU (see machine)
    target_weights: str  # the weights of the target path: its output follows that model
    tokens: list[int] = field(default_factory=list, repr=False)  # the decoded ids (not in JSON)
    draft_head_rows: int | None = None  # rows of lm_head a draft step reads (its vocabulary)
    # inside prefill_s: "attention" (every chunk's causal attention), "quantize" (the groups'
    # quantization into the planes, chunk by chunk); the rest is the linears, norms and RoPE
    prefill_stages_s: dict[str, float] = field(default_factory=dict)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first per second: the steady decoding rate (1 / TPOT)."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


PREFILL_STAGES = ("attention", "quantize", "linears")


def _median_run(runs: list[Run]) -> Run:
    """The run with the median prefill (the lower one of an even count): its stages add up."""
    ordered = sorted(runs, key=lambda r: r.prefill_s)
    return ordered[(len(ordered) - 1) // 2]


def _kv_bytes_per_token(mode: Mode, cache) -> dict[str, float]:
    """Bytes each path reads per history token, all layers (quantized history / plain KV)."""
    if isinstance(cache, HierarchicalKVCache):
        views = {"target": cache.bytes_per_token(mode.target.kv)}
        if mode.speculative:
            views["draft"] = cache.bytes_per_token(mode.draft.kv)
        return views
    per_token = cache.bytes_per_token()
    return {"target": per_token, "draft": per_token} if mode.speculative else {"ar": per_token}


@torch.inference_mode()
def run_once(
    runtime: Runtime,
    mode_name: str,
    prompt: list[int],
    gen: int,
    config: BenchConfig,
    seed: int,
) -> Run:
    """Prefill `prompt` into a fresh cache, then decode exactly `gen` tokens in `mode_name`."""
    return _run_once(runtime, mode_name, prompt, gen, config, seed)


def start_decode(runner, mode_name: str, prompt: list[int], gen: int, config, seed, timer):
    """Prefill `prompt` into a fresh cache of the mode's kind (timed as stage "prefill") and
    start decoding, every forward through `runner` (`qspec_core.runner.Runner`): returns
    (cache, the lazy generator of `gen` token ids, the round stats of a speculative mode or
    None). Nothing is decoded until the generator is iterated."""
    plan = config.plan(mode_name)
    target = plan.target
    cache = plan.new_cache(runner, len(prompt) + gen, config.group_size)
    with timer.stage("prefill"):
        if isinstance(cache, HierarchicalKVCache):
            logits = prefill_hierarchical(
                runner, cache, prompt, weights=target.weights, timer=timer
            )
        else:
            linears = linear_clock(runner)
            logits = prefill(runner, cache, prompt, 0, target)
            timer.add("prefill.attention", getattr(cache, "attention_seconds", 0.0))
            linears(timer)
    generator = torch.Generator(device=runner.device).manual_seed(seed)
    tokens, stats = plan.start(
        runner, cache, logits, prompt, gen, config.params, generator, (), timer
    )
    return cache, tokens, stats


def _run_once(runtime, mode_name, prompt, gen, config, seed) -> Run:
    mode = MODES[mode_name]
    cuda = runtime.model.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timer = StageTimer()
    start = time.perf_counter()
    runner = runtime.runner
    cache, tokens, stats = start_decode(runner, mode_name, prompt, gen, config, seed, timer)
    first = None
    out = []
    for token in tokens:
        if first is None:
            if cuda:
                torch.cuda.synchronize()
            first = time.perf_counter()
        out.append(int(token))
    if cuda:
        torch.cuda.synchronize()
    end = time.perf_counter()
    stages = {k: v for k, v in timer.seconds.items() if not k.startswith("prefill")}
    inside = {k.removeprefix("prefill."): v for k, v in timer.seconds.items() if "." in k}
    return Run(
        mode=mode_name,
        prompt_tokens=len(prompt),
        new_tokens=len(out),
        prefill_s=timer.seconds["prefill"],
        ttft_s=first - start,
        decode_s=end - first,
        stages_s=stages,
        spec=stats.to_dict(config.gamma_of(mode_name)) if stats is not None else None,
        kv_bytes_per_token=_kv_bytes_per_token(mode, cache),
        kv_cache_bytes=sum(cache.nbytes().values()),
        peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        target_weights=config.weights(mode_name),
        tokens=out,
        prefill_stages_s={k: v for k, v in inside.items() if k in PREFILL_STAGES},
        draft_head_rows=_draft_head_rows(runtime.model, prompt, config.plan(mode_name)),
    )


def _draft_head_rows(model, prompt: list[int], plan: DecodePlan) -> int | None:
    """Rows of lm_head the plan's draft steps read (its sliced vocabulary), None: no draft."""
    if plan.draft is None:
        return None
    return head_rows(model, prompt, plan.draft, plan.draft_common)


def step_lines(runs: list[Run], model, config: BenchConfig, bandwidth: float, layouts=None) -> dict:
    """Per step kind of a mode (decode; or draft and verify): ms per step, MB it must read and
    the fraction of the measured read bandwidth that is (`bench/bandwidth.py`), medians over
    the repeats. KV read at the run's middle length: the prompt plus half the new tokens (a
    local layer's: at most its window, `kv_read_positions`).
    `layouts`: the runner's `WeightLayouts` (its bf16 copies are what its steps read)."""
    mode = MODES[runs[0].mode]
    kinds = {}  # kind -> (weights, KV view key, [(seconds, steps, history tokens, kv B/token)])
    rows = {"draft": runs[0].draft_head_rows}  # (lm_head rows a step reads; verify: all)
    for r in runs:
        history = kv_read_positions(r.prompt_tokens + r.new_tokens / 2, model.config.windows)
        weights = config.weights(r.mode)
        if r.spec is None:
            key = "ar" if "ar" in r.kv_bytes_per_token else "target"
            kinds.setdefault("decode", (weights, key, []))[2].append(
                (r.decode_s, r.new_tokens - 1, history, r.kv_bytes_per_token[key])
            )
            continue
        draft_weights = mode.draft.weights if mode.draft.weights == "int4" else weights
        for kind, w, steps in (
            ("draft", draft_weights, r.spec["draft_steps"]),
            ("verify", weights, r.spec["rounds"]),
        ):
            view = "draft" if kind == "draft" else "target"
            kinds.setdefault(kind, (w, view, []))[2].append(
                (r.stages_s.get(kind, 0.0), steps, history, r.kv_bytes_per_token[view])
            )
    out = {}
    for kind, (weights, _, samples) in kinds.items():
        w = path_weight_bytes(model, weights, layouts, rows.get(kind))
        lines = [step_traffic(s, n, w, h * kv, bandwidth) for s, n, h, kv in samples]
        lines.sort(key=lambda line: line["ms"])
        out[kind] = lines[len(lines) // 2] | {"weights": weights}
    return out


def _weight_layouts(runner) -> WeightLayouts | None:
    """The runner's `WeightLayouts` (the CPU runner's), else None."""
    layouts = getattr(getattr(runner, "ops", None), "layouts", None)
    return layouts if isinstance(layouts, WeightLayouts) else None


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_mode(runs: list[Run], ar_runs: list[Run] | None) -> dict:
    """Medians and ranges over repeats; speedups pair repeat i of this mode with repeat i of ar."""
    out = {
        "about": MODES[runs[0].mode].about,
        "target_weights": runs[0].target_weights,
        "prompt_tokens": runs[0].prompt_tokens,
        "new_tokens": runs[0].new_tokens,
        "prefill_tokens_per_s": spread([r.prefill_tokens_per_s for r in runs]),
        "ttft_s": spread([r.ttft_s for r in runs]),
        "decode_tokens_per_s": spread([r.decode_tokens_per_s for r in runs]),
        "ms_per_token": spread([1000 * r.decode_s / max(1, r.new_tokens - 1) for r in runs]),
        "kv_bytes_per_token": runs[0].kv_bytes_per_token,
        "kv_cache_bytes": runs[0].kv_cache_bytes,
        "peak_memory_bytes": max((r.peak_memory_bytes or 0) for r in runs) or None,
        "speedup_vs_ar": None,
    }
    if ar_runs is not None:
        out["speedup_vs_ar"] = spread(
            [
                r.decode_tokens_per_s / a.decode_tokens_per_s
                for r, a in zip(runs, ar_runs, strict=True)
                if a.decode_tokens_per_s > 0
            ]
        )
    stage_names = sorted({k for r in runs for k in r.stages_s}, key=_stage_order)
    stages = {}
    for name in stage_names:
        seconds = [r.stages_s.get(name, 0.0) for r in runs]
        shares = [r.stages_s.get(name, 0.0) / sum(r.stages_s.values()) for r in runs]
        stages[name] = {"seconds": statistics.median(seconds), "share": statistics.median(shares)}
    out["stages"] = stages
    if runs[0].spec is not None:
        total = SpecStats()
        for r in runs:
            total.add(SpecStats.from_dict(r.spec))
        out["spec"] = total.to_dict(runs[0].spec["gamma"])
    out["runs"] = [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs]
    return out


def _stage_order(name: str) -> tuple[int, str]:
    order = ("decode",) + SPEC_STAGES
    return (order.index(name) if name in order else len(order), name)


def machine_info(runtime: Runtime, dtype: str) -> dict:
    model_name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = runtime.model.device
    return {
        "cpu": model_name,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
        "cpu_bf16_native": _cpu_bf16(),
        # the INT8-weight prefill product this machine measured fastest (runner/prefill_choice)
        "int8_prefill": prefill_path() if device.type == "cpu" else None,
        # the QuantSpec prefill attention's products (runner/products_choice: measured, or
        # QSPEC_PREFILL_PRODUCTS), None without the C++ kernels (the reference's fp32)
        "prefill_products": _prefill_products() if device.type == "cpu" else None,
    }


def _prefill_products() -> str | None:
    from kernels.cpu import attention as cpu_attention
    from qspec_core.runner.products_choice import prefill_products

    return prefill_products() if cpu_attention.available() else None


def _cpu_bf16() -> bool:
    from qspec_core.registry.runtime import cpu_has_fast_bf16

    return cpu_has_fast_bf16()


def run_bench(
    runtime: Runtime,
    config: BenchConfig,
    dtype: str,
    on_run: Callable[[str], None] | None = None,
) -> dict:
    """The whole benchmark; `on_run(label)` is called before each measured run (progress)."""
    check_config(config, runtime)
    prompts = {c: bench_prompt(runtime.tokenizer, c - config.gen) for c in config.contexts}
    if config.warmup:  # first calls pay for lazy setup (kernel packing, allocator growth)
        small = prompts[min(config.contexts)][: max(64, 2 * (config.group_size or 64))]
        for mode in config.modes:
            if on_run:
                on_run(f"warm-up {mode}")
            run_once(runtime, mode, small, WARMUP_TOKENS, config, config.seed)
    # the machine's read bandwidth and GEMM peaks, in this process and on these threads (CPU)
    on_cpu = runtime.model.device.type == "cpu"
    bandwidth = read_bandwidth() if on_cpu else None
    peaks = gemm_peaks() if on_cpu else None
    contexts = []
    for context in config.contexts:
        runs: dict[str, list[Run]] = {m: [] for m in config.modes}
        for repeat in range(config.repeats):
            for mode in config.modes:  # interleaved: A B C A B C ...
                if on_run:
                    on_run(f"{size_label(context)} {mode} #{repeat + 1}")
                runs[mode].append(
                    run_once(runtime, mode, prompts[context], config.gen, config, config.seed)
                )
        ar_runs = runs.get("ar")
        modes = {m: summarize_mode(runs[m], ar_runs) for m in config.modes}
        if bandwidth:
            for m in config.modes:
                modes[m]["steps"] = step_lines(
                    runs[m], runtime.model, config, bandwidth, _weight_layouts(runtime.runner)
                )
        if peaks:
            flops = prefill_flops(runtime.model.config, len(prompts[context]))
            for m in config.modes:
                median = _median_run(runs[m])
                modes[m]["prefill_compute"] = prefill_compute(
                    median.prefill_s, flops, peaks, median.prefill_stages_s
                )
        contexts.append(
            {"context": context, "prompt_tokens": len(prompts[context]), "modes": modes}
        )
    import qspec_core

    return {
        "qspec_version": qspec_core.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": runtime.name,
        "context_limit": runtime.context_limit,
        "machine": machine_info(runtime, dtype) | {"peak_rss_bytes": peak_rss_bytes()},
        "config": {
            "contexts": config.contexts,
            "gen": config.gen,
            "modes": list(config.modes),
            "repeats": config.repeats,
            "gamma": config.gamma,
            "temperature": config.params.temperature,
            "top_p": config.params.top_p,
            "top_k": config.params.top_k,
            "seed": config.seed,
            "group_size": config.group_size or runtime.model.config.head_dim,
            "target_weights": config.target_weights,
            "interleaved": True,
        },
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 2) if bandwidth else None,
        # the best GEMM rate per element type (`bench/compute.py`), GFLOP/s
        "gemm_peak_gflop_s": (
            {k: round(v / 1e9, 1) if v else None for k, v in peaks.items()} if peaks else None
        ),
        "contexts": contexts,
    }
