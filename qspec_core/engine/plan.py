"""How a mode decodes after its prefill, shared by chat sessions and the bench: the cache it
needs, and the token stream (autoregressive, or speculative with its draft sources)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from qspec_core.cache.full import FullPrecisionCache
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.draft_vocab import COMMON_IDS, DraftVocab
from qspec_core.engine.generate import decode
from qspec_core.engine.lookup import DocumentLookup
from qspec_core.engine.planner import RoundPlanner
from qspec_core.engine.proposers import DraftSource
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.speculative import SpecStats, speculative_decode
from qspec_core.precision import Precision
from qspec_core.runner.kernel_table import prefill_attention
from qspec_core.timing import StageTimer, StepCosts


@dataclass(frozen=True)
class DecodePlan:
    """Autoregressive on `target` (draft None), or speculative: drafts on the `draft` path
    (and from the prompt, with `lookup`), `gamma` a round or "auto", verified on `target`.
    `draft_common`: the draft scores the prompt's ids and the ids below it only
    (`draft_vocab.py`); None: the whole vocabulary. `trees`: with gamma "auto" and the lookup,
    the planner may verify the document's continuations as a token tree (`tree.py`)."""

    target: Precision
    draft: Precision | None = None
    gamma: int | str = "auto"
    lookup: bool = True
    draft_common: int | None = COMMON_IDS
    trees: bool = True

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    def new_cache(
        self, model, size: int, group_size: int | None = None, rope_capacity: int | None = None
    ):
        """A cache for the target's KV view: full precision ("fp"), else hierarchical, in
        `model`'s dtype and on its device (a model or its runner). `rope_capacity`: the
        sequence length LongRoPE picks its factors by (None: `size`; `KVCache`)."""
        where = dict(dtype=model.dtype, device=model.device, rope_capacity=rope_capacity)
        if self.target.kv == "fp":
            products = prefill_attention("full", model.device)  # (the runner's choice)
            return FullPrecisionCache(model.config, size, products=products, **where)
        return HierarchicalKVCache(model.config, size, group_size, **where)

    def start(
        self,
        runner,
        cache,
        first_logits: torch.Tensor,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop_ids: tuple[int, ...] = (),
        timer: StageTimer | None = None,
        planner: RoundPlanner | None = None,
        stats: SpecStats | None = None,
        costs: StepCosts | None = None,
    ) -> tuple[Iterator[int], SpecStats | None]:
        """The lazy stream of new ids after `prompt` (whose KV `cache` holds, committed, and
        whose last logits are `first_logits`), and the round stats a speculative plan fills
        (`stats`, or new ones), every forward through `runner` (`qspec_core.runner.Runner`).
        `costs`: the runtime's step timings (`StepCosts`), for `--gamma auto` to start from.
        Nothing is decoded until the stream is iterated."""
        timer = timer or StageTimer()
        common = (runner, cache, first_logits, len(prompt), max_new_tokens, params, generator)
        if not self.speculative:
            return decode(*common, stop_ids, path=self.target, timer=timer), None
        index = None
        if self.lookup:
            with timer.stage(DraftSource.LOOKUP):  # (a copy of the ids: searched when asked)
                index = DocumentLookup(prompt)
        vocab = None
        if self.draft_common is not None:  # (slicing the head: a few ms, at the first draft)
            model = getattr(runner, "model", runner)
            vocab = partial(DraftVocab.build, model, prompt, self.draft, self.draft_common)
        stats = stats if stats is not None else SpecStats()
        tokens = speculative_decode(
            *common, stop_ids, self.gamma, timer, stats, draft_path=self.draft,
            target_path=self.target, lookup=index, planner=planner, draft_vocab=vocab,
            costs=costs, trees=self.trees,
        )  # fmt: skip
        return tokens, stats
