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

from qspec_core.cache.full import FullCheckpoint, FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.cache.protocol import CacheCheckpoint
from qspec_core.engine.generate import prefill, prefill_hierarchical
from qspec_core.engine.plan import DecodePlan
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats
from qspec_core.errors import QspecError
from qspec_core.model.transformer import has_draft
from qspec_core.precision import DRAFT, Precision
from qspec_core.registry.runtime import Runtime
from qspec_core.timing import StageTimer

DOCUMENT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer questions about the document below, using only what "
    "it says.\n\n<document>\n{document}\n</document>"
)
SUMMARY_REQUEST = (
    "Summarize the document above in a few paragraphs: what it is, its main points, and "
    "any important conditions or conclusions."
)
# quantspec: self-speculative (4-bit weights + INT4 KV draft, target weights + INT8 KV verify)
# target-ar: autoregressive on the target path (the distribution quantspec reproduces)
# ar: autoregressive, the target weights over full-precision KV (the baseline)
MODES = ("quantspec", "target-ar", "ar")
# Tokens a `prefill --truncate` snapshot leaves free for a question and its answer: chat's
# default --max-new-tokens, so a truncated snapshot works with default settings (at most half
# the context, for small models).
SNAPSHOT_ANSWER_ROOM = 512


@dataclass
class ReplyStats:
    prompt_tokens: int = 0  # tokens of the rendered conversation before the reply
    prefilled_tokens: int = 0  # of those, how many had to be computed (the rest were cached)
    new_tokens: int = 0
    timings_s: dict[str, float] = field(default_factory=dict)
    spec: SpecStats | None = None  # quantspec rounds, acceptance

    @property
    def generation_s(self) -> float:
        """Seconds spent generating: every stage after the prefill (decode, or a round's
        draft/verify/accept/rollback/rotate)."""
        return sum(v for k, v in self.timings_s.items() if k not in ("tokenize", "prefill"))

    @property
    def decode_tokens_per_s(self) -> float:
        s = self.generation_s
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
        if other.spec is not None:
            if self.spec is None:
                self.spec = SpecStats()
            self.spec.add(other.spec)


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
        mode: str = "quantspec",
        truncate: bool = False,
        capacity: int | None = None,
        gamma: int | str = "auto",
        group_size: int | None = None,
        lookup: bool = True,
        trees: bool = True,
    ):
        if mode not in MODES:
            raise QspecError(f"mode {mode!r} is not available (have: {', '.join(MODES)})")
        if mode == "quantspec" and not has_draft(runtime.model):
            raise QspecError(
                f"{runtime.name} has no 4-bit draft weights: convert it first "
                f"(qspec convert {runtime.name} -o DIR, then --model DIR), or use --mode "
                "target-ar / ar"
            )
        self.gamma = gamma
        self.group_size = group_size
        self.lookup = lookup  # quantspec also drafts from the conversation (`lookup.py`)
        self.trees = trees  # ... and may verify its continuations as a tree (`tree.py`)
        self.planner = None  # with gamma "auto": a `RoundPlanner` to use instead of a new one
        self.runtime = runtime
        self.params = params or SamplingParams()
        self.max_new_tokens = max_new_tokens
        self.generator = torch.Generator(device=runtime.model.device)
        self.generator.manual_seed(0 if seed is None else seed)
        self.mode = mode
        self.truncated_tokens = 0
        self.can_truncate = document is not None  # (--truncate could cut the document)
        self.history: list[dict] = []
        if document is not None and not truncate:
            self._check_not_far_too_long(document)
        self.document = self._fit_document(document) if truncate else document
        self.totals = ReplyStats()  # every reply's stats, stopped ones included
        self.turns = 0  # finished answers (in the history)
        self.stopped = 0  # replies cancelled mid-way (counted in totals, not in the history)
        self.capacity = capacity
        self._cache: FullPrecisionCache | HierarchicalKVCache | None = None
        self._cached_ids: list[int] = []
        # (n_tokens, checkpoint) of the hierarchical cache holding exactly the document
        # prefix: a later question goes back there even after answers were quantized
        self._doc_point: tuple[int, CacheCheckpoint | FullCheckpoint] | None = None

    @property
    def limit(self) -> int:
        return self.runtime.context_limit

    def messages(self, question: str | None = None) -> list[dict]:
        extra = [{"role": "user", "content": question}] if question is not None else []
        return document_messages(self.document) + self.history + extra

    def prompt_ids(self, question: str) -> list[int]:
        return self.runtime.tokenizer.encode_chat(self.messages(question), True)

    def check_fits(self, prompt_tokens: int, question: str | None = None) -> None:
        """QspecError if the prompt and `max_new_tokens` exceed the context, advising only
        what would make them fit."""
        need = prompt_tokens + self.max_new_tokens
        if need <= self.limit:
            return
        over, tok = need - self.limit, self.runtime.tokenizer
        doc, fixes = "", []
        if self.document is not None:
            n_doc = len(tok.encode(self.document))
            doc = f"the document is {n_doc} tokens, "
            # (a snapshot's document, or one cut already, is what it is)
            if self.can_truncate and not self.truncated_tokens and n_doc > over:
                fixes.append("--truncate to keep the start of the document")
        if prompt_tokens < self.limit:
            fixes.append(f"--max-new-tokens {self.limit - prompt_tokens} or less")
        if question is not None and len(tok.encode(question)) > over:
            fixes.append("a shorter question")
        if self.history and question is not None:  # (earlier turns take room: enough?)
            alone = document_messages(self.document) + [{"role": "user", "content": question}]
            if len(tok.encode_chat(alone, True)) + self.max_new_tokens <= self.limit:
                fixes.append("/reset the conversation")
        fixes = fixes or ["a shorter question"]  # (nothing else would make it fit)
        advice = ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]
        raise QspecError(
            f"too long for {self.runtime.name}: {doc}the prompt is {prompt_tokens} tokens and "
            f"{self.max_new_tokens} new tokens are allowed, {need} in all, but the model's "
            f"context is {self.limit} tokens. Use {advice}"
        )

    def _check_not_far_too_long(self, document: str) -> None:
        """Refuse, before tokenizing it, a document whose bytes alone show it cannot fit."""
        at_least = self.runtime.tokenizer.min_tokens(document)
        if at_least >= self.limit:  # (the document alone: --max-new-tokens is check_fits')
            raise QspecError(
                f"too long for {self.runtime.name}: the document is at least {at_least} tokens "
                f"(from its size alone), but the model's context is {self.limit} tokens. Use "
                "--truncate to keep the start of the document"
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

    @property
    def plan(self) -> DecodePlan:
        """How this session's mode decodes (`engine/plan.py`)."""
        if self.mode == "quantspec":
            return DecodePlan(self.runtime.target, DRAFT, self.gamma, self.lookup, trees=self.trees)
        return DecodePlan(self.path)

    @property
    def path(self) -> Precision:
        """The path that answers (decodes or verifies), on the runtime's target weights."""
        return self.runtime.baseline if self.mode == "ar" else self.runtime.target

    def _ensure_cache(self, need: int):
        """The session's cache, holding at least `need` positions: made at what the first
        question needs (or `capacity`), grown by half again at least when a later one needs
        more, so a long chat copies it a few times, not once a turn. Every mode's sequence
        rotates as the session's planned length says (LongRoPE), whatever the cache holds."""
        planned = self.capacity or self.limit
        if self._cache is None:
            size = min(self.limit, max(need, self.capacity or 0))
            self._cache = self.plan.new_cache(self.runtime.model, size, self.group_size, planned)
        elif self._cache.max_seq_len < need:
            self._cache.grow(min(self.limit, max(need, self._cache.max_seq_len * 3 // 2)))
        return self._cache

    def document_prefix_ids(self) -> list[int]:
        """Tokens of the document framing alone: the prefix every question shares."""
        if self.document is None:
            return []
        return self.runtime.tokenizer.encode_chat(document_messages(self.document), False)

    def _prefill(self, cache, ids: list[int], reuse: int, progress) -> torch.Tensor:
        """Bring the cache from ids[:reuse] to ids; return the last position's logits.

        Hierarchical cache, empty: the document prefix goes in as QuantSpec's prefill
        (quantized chunk by chunk as it goes, `cache/prefill.py`), the rest through the target
        path in chunks of G, committing as it goes; so chatting from a saved prefix and
        from the document give the same cache.
        """
        runner = self.runtime.runner
        if self.mode == "ar":
            doc = self.document_prefix_ids() if cache.window is not None and not reuse else []
            if doc and ids[: len(doc)] == doc and len(doc) < len(ids):
                # local layers drop their old keys as the answer goes on: a way back to the
                # document's end for the next question
                prefill(runner, cache, doc, 0, self.path, on_progress=progress)
                self._doc_point, reuse = (len(doc), cache.checkpoint()), len(doc)
            return prefill(runner, cache, ids[reuse:], reuse, self.path, on_progress=progress)
        if reuse == 0:
            doc = self.document_prefix_ids()
            head = doc if doc and ids[: len(doc)] == doc and len(doc) < len(ids) else ids[:1]
            weights = self.runtime.target_weights
            logits = prefill_hierarchical(
                runner, cache, head, on_progress=progress, weights=weights
            )
            reuse = len(head)
            self._doc_point = (len(doc), cache.checkpoint()) if head == doc else None
            if reuse == len(ids):
                return logits
        return prefill(
            runner,
            cache,
            ids[reuse:],
            reuse,
            self.path,
            chunk_size=cache.group_size,
            on_progress=progress,
        )

    def ask(
        self,
        question: str,
        on_prefill: Callable[[int], Callable[[int], None]] | None = None,
    ) -> Iterator[str]:
        """Stream the reply to `question` as text pieces; `self.last` holds its stats after.

        `on_prefill(n_tokens)` may return a progress callback for the prefill. If the reply
        is cancelled (the generator is closed, or Ctrl-C), the question stays out of the
        history: the next answer is what it would have been without it.
        """
        timer = StageTimer()
        with timer.stage("tokenize"):
            ids = self.prompt_ids(question)
        self.check_fits(len(ids), question)
        cache = self._ensure_cache(len(ids) + self.max_new_tokens)
        reuse = min(common_prefix(ids, self._cached_ids[: cache.seq_len]), len(ids) - 1)
        if reuse < cache.rewind_floor:
            # the divergence lies in the quantized history (or, for the full cache, before
            # the keys its local layers keep): back to the document's end if it is still
            # shared (the usual case: /reset, or an answer quantized past the document),
            # else start over
            point = self._doc_point
            if point is not None and reuse >= point[0]:
                cache.restore(point[1])
                reuse = point[0]
            else:
                reuse = 0
                cache.reset()
        cache.truncate(reuse)
        stats = ReplyStats(prompt_tokens=len(ids), prefilled_tokens=len(ids) - reuse)
        if self.mode == "quantspec":
            stats.spec = SpecStats()
        self.last = stats
        generated: list[int] = []
        text = ""
        finished = False
        try:
            progress = on_prefill(len(ids) - reuse) if on_prefill else None
            with timer.stage("prefill"):
                logits = self._prefill(cache, ids, reuse, progress)
            tokens, _ = self.plan.start(
                self.runtime.runner, cache, logits, ids, self.max_new_tokens, self.params,
                self.generator, self.runtime.stop_ids, timer, self.planner, stats.spec,
                self.runtime.costs,
            )  # fmt: skip
            try:
                for token in tokens:
                    generated.append(token)
                    new_text = self.runtime.tokenizer.decode(generated)
                    if new_text.endswith("\ufffd"):
                        continue  # an incomplete UTF-8 sequence: wait for the next token
                    yield new_text[len(text) :]
                    text = new_text
            finally:
                tokens.close()  # the engine rolls the cache back to what it committed
            finished = True
        finally:
            self._cached_ids = ids + generated
            stats.new_tokens = len(generated)
            if generated and generated[-1] in self.runtime.stop_ids:
                generated = generated[:-1]
            stats.timings_s = dict(timer.seconds)
            reply = self.runtime.tokenizer.decode(generated).strip()
            self.last_text = reply
            if finished:
                self.history += [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": reply},
                ]
                self.turns += 1
            else:
                self.stopped += 1
            self.totals.add(stats)

    def prefill_document(self, on_prefill=None) -> tuple[HierarchicalKVCache, list[int]]:
        """QuantSpec's prefill of the document prefix alone (what a snapshot stores)."""
        if self.document is None or self.mode == "ar":
            raise QspecError("a snapshot needs a document and a quantized mode")
        ids = self.document_prefix_ids()
        cache = self._ensure_cache(len(ids) + 1)
        cache.reset()
        progress = on_prefill(len(ids)) if on_prefill else None
        weights = self.runtime.target_weights  # (the KV a later verify on these weights reads)
        runner = self.runtime.runner
        prefill_hierarchical(runner, cache, ids, on_progress=progress, weights=weights)
        self._cached_ids = list(ids)
        return cache, list(ids)

    def adopt_cache(self, cache: HierarchicalKVCache, token_ids: list[int]) -> None:
        """Continue from a loaded snapshot: `cache` holds exactly `token_ids`, committed."""
        if self.mode == "ar":
            raise QspecError(
                "snapshots hold the quantized cache: use --mode quantspec or "
                "target-ar with a snapshot"
            )
        if token_ids != self.document_prefix_ids():
            raise QspecError(
                "the snapshot's tokens do not match its document under this "
                "tokenizer and chat template"
            )
        self._cache, self._cached_ids = cache, list(token_ids)
        self.can_truncate = False  # (the snapshot's document is fixed)
        self._doc_point = (len(token_ids), cache.checkpoint())

    def reset(self) -> None:
        """Forget the conversation, keep the document (its KV stays cached)."""
        self.history = []
        self.totals = ReplyStats()
        self.turns = 0
        self.stopped = 0
