"""A conversation about one document: chat template framing, KV reuse across turns, stats.

The cache keeps the token ids whose KV it holds (`_cached_ids`); each turn renders the whole
conversation, reuses the longest common prefix and prefills only the rest. That makes a
follow-up question cost only its own tokens, and makes any mismatch (an interrupted reply, a
retokenized answer, /reset) correct by construction rather than by bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from qspec_core.errors import QspecError
from qspec_core.generate import decode, prefill
from qspec_core.kv_cache import FullPrecisionCache
from qspec_core.runtime import Runtime
from qspec_core.sampling import SamplingParams
from qspec_core.timing import StageTimer

DOCUMENT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer questions about the document below, using only what "
    "it says.\n\n<document>\n{document}\n</document>"
)
SUMMARY_REQUEST = (
    "Summarize the document above in a few paragraphs: what it is, its main points, and "
    "any important conditions or conclusions."
)
MODES = ("ar",)


@dataclass
class ReplyStats:
    prompt_tokens: int = 0  # tokens of the rendered conversation before the reply
    prefilled_tokens: int = 0  # of those, how many had to be computed (the rest were cached)
    new_tokens: int = 0
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        s = self.timings_s.get("decode", 0.0)
        return self.new_tokens / s if s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        s = self.timings_s.get("prefill", 0.0)
        return self.prefilled_tokens / s if s > 0 else 0.0

    def add(self, other: ReplyStats) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.prefilled_tokens += other.prefilled_tokens
        self.new_tokens += other.new_tokens
        for k, v in other.timings_s.items():
            self.timings_s[k] = self.timings_s.get(k, 0.0) + v


def document_messages(document: str | None) -> list[dict]:
    if document is None:
        return []
    return [{"role": "system", "content": DOCUMENT_SYSTEM_PROMPT.format(document=document.strip())}]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """Multi-turn chat over an optional document with a full-precision cache (mode `ar`)."""

    def __init__(
        self,
        runtime: Runtime,
        document: str | None = None,
        params: SamplingParams | None = None,
        seed: int | None = None,
        max_new_tokens: int = 512,
        mode: str = "ar",
        truncate: bool = False,
        capacity: int | None = None,
    ):
        if mode not in MODES:
            raise QspecError(f"mode {mode!r} is not available yet (have: {', '.join(MODES)})")
        self.runtime = runtime
        self.params = params or SamplingParams()
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator(device=runtime.model.device)
        self.generator.manual_seed(0 if seed is None else seed)
        self.mode = mode
        self.truncated_tokens = 0
        self.history: list[dict] = []
        self.document = self._fit_document(document) if truncate else document
        self.totals = ReplyStats()
        self.turns = 0
        self.capacity = capacity
        self._cache: FullPrecisionCache | None = None
        self._cached_ids: list[int] = []

    @property
    def limit(self) -> int:
        return self.runtime.context_limit

    def messages(self, question: str | None = None) -> list[dict]:
        extra = [{"role": "user", "content": question}] if question is not None else []
        return document_messages(self.document) + self.history + extra

    def prompt_ids(self, question: str) -> list[int]:
        return self.runtime.tokenizer.encode_chat(self.messages(question), True)

    def check_fits(self, prompt_tokens: int) -> None:
        need = prompt_tokens + self.max_new_tokens
        if need > self.limit:
            doc = ""
            if self.document is not None:
                n_doc = len(self.runtime.tokenizer.encode(self.document))
                doc = f"the document is {n_doc} tokens, "
            raise QspecError(
                f"too long for {self.runtime.name}: {doc}the prompt is {prompt_tokens} tokens and "
                f"{self.max_new_tokens} new tokens are allowed, {need} in all, but the model's "
                f"context is {self.limit} tokens. Use --truncate to keep the start of the "
                f"document, lower --max-new-tokens, or /reset the conversation"
            )

    def _fit_document(self, document: str | None) -> str | None:
        """Cut the document's tail so that the first question and the reply fit."""
        if document is None:
            return None
        tok = self.runtime.tokenizer
        self.document = ""
        overhead = len(self.prompt_ids(SUMMARY_REQUEST)) + 16  # framing + a typical question
        doc_ids = tok.encode(document)
        budget = self.limit - self.max_new_tokens - overhead
        if budget <= 0:
            raise QspecError(
                f"--max-new-tokens {self.max_new_tokens} leaves no room for the "
                f"document in a {self.limit}-token context"
            )
        if len(doc_ids) <= budget:
            return document
        self.truncated_tokens = len(doc_ids) - budget
        return tok.decode(doc_ids[:budget])

    def _ensure_cache(self, need: int) -> FullPrecisionCache:
        size = min(self.limit, max(need, self.capacity or 0))
        if self._cache is None:
            model = self.runtime.model
            self._cache = FullPrecisionCache(
                model.config, size, dtype=model.dtype, device=model.device
            )
        elif self._cache.max_seq_len < need:
            self._cache.grow(size)
        return self._cache

    def ask(
        self,
        question: str,
        on_prefill: Callable[[int], Callable[[int], None]] | None = None,
    ) -> Iterator[str]:
        """Stream the reply to `question` as text pieces; `self.last` holds its stats after.

        `on_prefill(n_tokens)` may return a progress callback for the prefill.
        """
        timer = StageTimer()
        with timer.stage("tokenize"):
            ids = self.prompt_ids(question)
        self.check_fits(len(ids))
        cache = self._ensure_cache(len(ids) + self.max_new_tokens)
        reuse = min(common_prefix(ids, self._cached_ids[: cache.seq_len]), len(ids) - 1)
        cache.truncate(reuse)
        stats = ReplyStats(prompt_tokens=len(ids), prefilled_tokens=len(ids) - reuse)
        self.last = stats
        generated: list[int] = []
        text = ""
        try:
            progress = on_prefill(len(ids) - reuse) if on_prefill else None
            with timer.stage("prefill"):
                logits = prefill(
                    self.runtime.model, cache, ids[reuse:], reuse, on_progress=progress
                )
            for token in decode(
                self.runtime.model,
                cache,
                logits,
                len(ids),
                self.max_new_tokens,
                self.params,
                self.generator,
                self.runtime.stop_ids,
                timer=timer,
            ):
                generated.append(token)
                new_text = self.runtime.tokenizer.decode(generated)
                if new_text.endswith("\ufffd"):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                yield new_text[len(text) :]
                text = new_text
        finally:
            self._cached_ids = ids + generated
            stats.new_tokens = len(generated)
            if generated and generated[-1] in self.runtime.stop_ids:
                generated = generated[:-1]
            stats.timings_s = dict(timer.seconds)
            reply = self.runtime.tokenizer.decode(generated).strip()
            self.history += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": reply},
            ]
            self.last_text = reply
            self.totals.add(stats)
            self.turns += 1

    def reset(self) -> None:
        """Forget the conversation, keep the document (its KV stays cached)."""
        self.history = []
        self.totals = ReplyStats()
        self.turns = 0
