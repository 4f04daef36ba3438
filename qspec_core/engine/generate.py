"""Autoregressive generation over a preallocated cache: chunked prefill, then token by token.

Every forward goes through a `Runner` (`qspec_core/runner/`: the runtime's, or the model
itself for its PyTorch reference)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.cache.prefill import ChunkedPrefill
from qspec_core.cache.protocol import KVCache
from qspec_core.engine.sampling import SamplingParams, generator_seed, sample_at
from qspec_core.precision import FP, Precision
from qspec_core.runner import Runner
from qspec_core.runner.kernel_table import prefill_attention
from qspec_core.timing import StageTimer

PREFILL_CHUNK = 512


@torch.inference_mode()
def prefill(
    runner: Runner,
    cache: KVCache,
    tokens: list[int],
    start_pos: int,
    path: Precision = FP,
    chunk_size: int = PREFILL_CHUNK,
    on_progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Feed `tokens` at positions start_pos.. in chunks; return the last position's logits [V].

    Chunking bounds the attention workspace ([H, chunk, context]) on long documents.
    """
    if not tokens:
        raise ValueError("prefill needs at least one token")
    ids = torch.tensor(tokens, dtype=torch.long, device=runner.device)[None]  # [1, T]
    logits = None
    for begin in range(0, len(tokens), chunk_size):
        chunk = ids[:, begin : begin + chunk_size]
        pos = torch.arange(start_pos + begin, start_pos + begin + chunk.shape[1], device=ids.device)
        logits = runner(chunk, pos, cache, path, last_only=True)
        cache.commit(cache.seq_len)  # prompt tokens are given, hence confirmed
        if on_progress is not None:
            on_progress(chunk.shape[1])
    return logits[0, -1]


@torch.inference_mode()
def prefill_hierarchical(
    runner: Runner,
    cache: HierarchicalKVCache,
    tokens: list[int],
    chunk_size: int = PREFILL_CHUNK,
    on_progress: Callable[[int], None] | None = None,
    weights: str = "full",
    timer: StageTimer | None = None,
) -> torch.Tensor:
    """QuantSpec's prefill into `cache` (emptied first), quantizing chunk by chunk as the
    K/V are made (`cache/prefill.py`: no full-precision copy of the whole prompt).

    Returns the last position's logits [V], computed on `weights` (the target's: "full",
    "int8" or "w8a8", `Runtime.target_weights`). `timer` gets the stages inside:
    "prefill.attention" (every chunk's causal attention, with the history's dequantization),
    "prefill.quantize" (the groups' quantization into the planes) and, where the runner times
    them (`linear_clock`), "prefill.linears"; the rest is norms, RoPE, the embedding and
    Python. On any exception (Ctrl-C included) the cache is left empty.
    """
    cache.reset()
    products = prefill_attention("hierarchical", cache.fp_k.device)  # (the runner's choice)
    scratch = ChunkedPrefill(cache, chunk_size, products)
    linears = linear_clock(runner)
    try:
        path = FP.with_weights(weights)
        logits = prefill(runner, scratch, tokens, 0, path, chunk_size, on_progress)
        scratch.finish()
    except BaseException:
        cache.reset()  # (nothing half-written: no layer holds part of the prompt)
        raise
    timer = timer or StageTimer()
    timer.add("prefill.attention", scratch.attention_seconds)
    timer.add("prefill.quantize", scratch.quantize_seconds)
    linears(timer)
    return logits


def linear_clock(runner) -> Callable[[StageTimer], None]:
    """A stopwatch of the runner's linears from now: called with a timer, it adds the seconds
    its layer loop spent in linears since to stage "prefill.linears". Runners that do not
    count them (`linear_seconds`: the CPU runner's; a GPU's calls are asynchronous) add
    nothing; a chunk of at most `kernels.MAX_STEP_ROWS` rows that runs on the CPU runner's
    C++ step stack (an fp32 model, a cache with a C++ side) is in no stage."""
    start = getattr(runner, "linear_seconds", None)
    if start is None:
        return lambda timer: None
    return lambda timer: timer.add("prefill.linears", runner.linear_seconds - start)


@torch.inference_mode()
def decode(
    runner: Runner,
    cache: KVCache,
    first_logits: torch.Tensor,
    start_pos: int,
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    stop_ids: tuple[int, ...] = (),
    path: Precision = FP,
    timer: StageTimer | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` ids; stop after yielding a stop id.

    `first_logits` [V] are the prefill's last logits; the token sampled from them sits at
    `start_pos`. Each token is yielded before it is fed back, so whenever the caller stops
    (stop token, limit, Ctrl-C) `cache.seq_len` counts exactly the positions whose KV is in.
    """
    timer = timer or StageTimer()
    logits = first_logits
    pos = start_pos
    seed = generator_seed(generator)
    for i in range(max_new_tokens):
        with timer.stage("decode"):
            token = sample_at(logits, params, seed, pos)  # (keyed by position: `draw`)
        yield token
        if token in stop_ids or i == max_new_tokens - 1:
            return
        with timer.stage("decode"):
            tok = torch.tensor([[token]], device=runner.device)
            logits = runner(tok, torch.tensor([pos], device=runner.device), cache, path)[0, -1]
            cache.commit(pos + 1)  # autoregressive: every fed token is final
        pos += 1
