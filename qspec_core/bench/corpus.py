"""Real text for benchmark prompts: bundled licence texts, concatenated, never one repeated.

The texts are verbatim copies of free-software licences, whose terms allow verbatim copying
(`data/SOURCES.md`). Together they are about 37k tokens for a Llama-style tokenizer, enough for
a 32k-token context.
"""

from __future__ import annotations

from qspec_core.engine.session import SUMMARY_REQUEST, document_messages
from qspec_core.errors import QspecError
from qspec_core.paths import BUNDLED_TEXTS

DATA = BUNDLED_TEXTS
# Fixed order: a prompt of N tokens is a prefix of the prompt of any larger N (same document).
TEXTS = (
    "gpl-3.0.txt",
    "apache-2.0.txt",
    "lgpl-2.1.txt",
    "mpl-2.0.txt",
    "gfdl-1.3.txt",
    "gpl-2.0.txt",
    "mpl-1.1.txt",
    "gpl-1.0.txt",
    "cc0-1.0.txt",
    "artistic-1.0.txt",
)


def corpus_text() -> str:
    return "\n\n".join((DATA / name).read_text(encoding="utf-8").strip() for name in TEXTS)


def bench_prompt(tokenizer, n_tokens: int) -> list[int]:
    """A chat prompt of at most `n_tokens` (and within a few of it): as much of the corpus as
    fits as the document, then the summary request, in the model's chat template."""
    doc_ids = tokenizer.encode(corpus_text())
    overhead = len(tokenizer.encode_chat(_messages(""), True))
    budget = n_tokens - overhead
    if budget > len(doc_ids):
        raise QspecError(
            f"the bundled benchmark text has {len(doc_ids)} tokens for this tokenizer, fewer "
            f"than the {n_tokens}-token prompt asked for"
        )
    for _ in range(8):  # decode/re-encode can shift a token or two at the cut
        ids = tokenizer.encode_chat(_messages(tokenizer.decode(doc_ids[: max(budget, 0)])), True)
        if len(ids) <= n_tokens:
            return ids
        budget -= len(ids) - n_tokens
    raise QspecError(f"could not fit a benchmark prompt into {n_tokens} tokens")


def _messages(document: str) -> list[dict]:
    return document_messages(document) + [{"role": "user", "content": SUMMARY_REQUEST}]
