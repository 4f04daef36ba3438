"""What a forward computes: which weights and which KV view. The one vocabulary of paths.

QuantSpec runs one model two ways over one cache. A forward's `Precision` names both halves:

    weights  "full"  the checkpoint's weights (fp32/bf16/fp16, as loaded)
             "int8"  every linear's INT8 twin (W8A16 per-channel; `qspec convert` makes them)
             "w8a8"  the same INT8 twins with the activations rounded to int8 per 64 inputs
                     (W8A8; `kernels.formats.quantize_activations`): integer dot products
             "int4"  each linear's 4-bit twin (the draft; `qspec convert` gives one to every
                     linear its recipe names; a layer without one, as lm_head in the default
                     model's recipe or in most imported drafts, runs its INT8 twin, W8A8)
    kv       "fp"    a full-precision cache (`cache.FullPrecisionCache`)
             "int8"  the hierarchical cache read through both planes (upper and lower nibble)
             "int4"  the hierarchical cache read through the upper plane only

The model picks weights by `weights`, the cache picks its view by `kv`, the kernels take the
view as "int8"/"int4", and bench modes and sessions are pairs of these. Nothing is switched by
mutating the model: a verify on INT8 weights is just a forward with `weights="int8"`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

WEIGHTS = ("full", "int8", "w8a8", "int4")
INT8_WEIGHTS = ("int8", "w8a8")  # the sets that run each linear's INT8 twin
# The sets whose CPU kernels round activations to int8 (W8A8; the draft's W4A8, where a layer's
# format allows it): over the hierarchical cache on a CPU they round the queries to int16, per
# head and K group, and score the quantized history with integer dot products
# (`kernels/cpu/attention_int.h`). The draft does so even where a layer keeps fp activations:
# its numbers only move its acceptance.
INT_QUERY_WEIGHTS = ("w8a8", "int4")
KV_VIEWS = ("fp", "int8", "int4")


@dataclass(frozen=True)
class Precision:
    weights: str = "full"
    kv: str = "fp"

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, not {self.weights!r}")
        if self.kv not in KV_VIEWS:
            raise ValueError(f"kv must be one of {KV_VIEWS}, not {self.kv!r}")

    @property
    def int_queries(self) -> bool:
        """Whether this path rounds its queries to int16 over the hierarchical planes (on a CPU;
        see INT_QUERY_WEIGHTS)."""
        return self.weights in INT_QUERY_WEIGHTS and self.kv in ("int8", "int4")

    def with_weights(self, weights: str) -> Precision:
        return replace(self, weights=weights)

    @property
    def name(self) -> str:
        return NAMES.get(self, f"{self.weights}-weights/{self.kv}-kv")

    def __str__(self) -> str:
        return self.name


FP = Precision("full", "fp")  # the baseline: full weights, full-precision KV
TARGET = Precision("full", "int8")  # QuantSpec's verify: full weights over the INT8 view
DRAFT = Precision("int4", "int4")  # QuantSpec's draft: 4-bit weights over the INT4 view
DRAFT_KV4 = Precision("full", "int4")  # ablation: full weights over the INT4 view
DRAFT_W4 = Precision("int4", "fp")  # ablation: 4-bit weights, full-precision KV
W8 = Precision("int8", "fp")  # INT8 weights, full-precision KV
W8_TARGET = Precision("int8", "int8")  # Quasar's verify: INT8 weights over the INT8 view

NAMES = {
    FP: "fp",
    TARGET: "target",
    DRAFT: "draft",
    DRAFT_KV4: "draft-kv4",
    DRAFT_W4: "draft-w4",
    W8: "w8",
    W8_TARGET: "w8-target",
}
