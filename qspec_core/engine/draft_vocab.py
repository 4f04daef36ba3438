"""The draft's vocabulary: the 4-bit draft scores only the tokens it is likely to propose.

A draft step's vocabulary projection reads the whole head (SmolLM2-135M: 49,152 x 576 INT8,
28 MB, a fifth of the draft step's bytes at 2k; Llama 3.2 1B: 128,256 x 2,048 in 4 bits,
147 MB with its scales, a fifth of its draft step's), yet the draft only has to propose tokens the
target will accept, and those come, almost always, from the document or from the tokenizer's
common tokens. So the draft's head is sliced once per decode to those rows (`vocab_head`):
the prompt's ids and the ids below `common` (a BPE vocabulary numbers its merges by
frequency, so its low ids are its common tokens and single bytes).

Exactness does not depend on the choice: the target verifies every draft. Greedy: a target
token outside the slice is never proposed, so that position is rejected (and recovered by the
verify, as any mismatch). Sampling: the draft samples from q restricted to the slice
(renormalized, zero elsewhere: `DraftVocab.full`), and the rejection rule is exact for any q.
"""

from __future__ import annotations

import torch

from qspec_core.model.transformer import Linear
from qspec_core.precision import Precision
from qspec_core.quant.int4 import Int4Linear
from qspec_core.quant.int8 import Int8Linear

# ids kept below this whatever the document (SmolLM2's 49,152: its most common sixth)
COMMON_IDS = 8192


def draft_ids(prompt: list[int], vocab_size: int, common: int = COMMON_IDS) -> torch.Tensor:
    """The draft's vocabulary: ids < common and the prompt's ids, sorted, int64 [n]."""
    ids = torch.tensor(prompt, dtype=torch.long)
    ids = ids[(ids >= common) & (ids < vocab_size)]
    return torch.cat([torch.arange(min(common, vocab_size)), ids.unique()])


def can_slice(head: Linear, path: Precision) -> bool:
    """Whether `head` on `path` can be sliced by rows: its 4-bit or INT8 twin or its own
    weight, without a bias (else the draft keeps the whole head)."""
    twin = head.twin(path.weights)
    return head.bias is None and (twin is None or isinstance(twin, (Int4Linear, Int8Linear)))


def head_rows(model, prompt: list[int], path: Precision, common: int | None = COMMON_IDS) -> int:
    """Rows of `model.lm_head` a draft step on `path` reads: its slice's for this prompt
    (`DraftVocab.build`), or all of them (`common` None: no slice)."""
    V = model.lm_head.out_features
    if common is None or not can_slice(model.lm_head, path):
        return V
    return len(draft_ids(prompt, V, common))  # (at most V: ids past the vocabulary dropped)


def vocab_head(model, ids: torch.Tensor, path: Precision) -> Linear | None:
    """A `Linear` computing `model.lm_head`'s logits of `ids` on `path` only (the rows of its
    4-bit or INT8 twin, or of its own weight on a full-weight path), or None where the head
    cannot be sliced (`can_slice`)."""
    head = model.lm_head
    if not can_slice(head, path):
        return None
    twin = head.twin(path.weights)
    n, k = len(ids), head.in_features
    rows = ids.to(head.weight.device)
    if twin is None:
        sub = Linear(k, n, bias=False, device=head.weight.device, dtype=head.weight.dtype)
        sub.weight.data.copy_(head.weight.data[rows])
    else:  # the full-precision weight is never read on this path: no copy of it
        sub = Linear(k, n, bias=False, device="meta")
        if isinstance(twin, Int4Linear):
            sub.draft = twin.rows(rows)
        else:
            sub.int8 = Int8Linear.from_quantized(twin.weight_int8[rows], twin.weight_scale[rows])
    sub.requires_grad_(False)
    return sub


class DraftVocab:
    """The draft's sliced head and the map back: logits [.., n] over `ids` -> token ids, or
    -> logits [.., V] with -inf outside the slice (for sampling from q)."""

    def __init__(self, ids: torch.Tensor, head: Linear, vocab_size: int):
        self.ids, self.head, self.vocab_size = ids, head, vocab_size
        self._ids_list = ids.tolist()

    @classmethod
    def build(cls, model, prompt: list[int], path: Precision, common: int = COMMON_IDS):
        """The slice for this prompt on `path`, or None where slicing does not apply (a
        4-bit or biased head, or a slice no smaller than the head)."""
        V = model.lm_head.out_features
        ids = draft_ids(prompt, V, common)
        if len(ids) >= V:
            return None
        head = vocab_head(model, ids, path)
        return None if head is None else cls(ids, head, V)

    def token(self, index: int) -> int:
        return self._ids_list[index]

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [n] over the slice -> [V], -inf outside it."""
        out = logits.new_full((self.vocab_size,), float("-inf"))
        out[self.ids.to(logits.device)] = logits
        return out
