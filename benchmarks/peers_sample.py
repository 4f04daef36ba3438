"""What every peer is given and what one run gives back: the prompt and the timed sample.

Stdlib only at import time: the llama.cpp worker imports this under an interpreter that may
have neither torch nor qspec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "qspec_core" / "data"


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
