"""Named draft recipes (`qspec convert --recipe NAME`): how the 4-bit draft is made.

A recipe fixes the quantizer, the group size, which linear layers get a 4-bit twin and GPTQ's
damping. A layer a recipe leaves out drafts on its INT8 twin (`model.Linear.twin`), which the
verifier holds anyway, so a smaller draft costs no memory: only bytes per draft step.

Which layers ("modules"):
    all       every linear, lm_head included (the smallest draft step)
    no-head   every decoder linear; lm_head drafts on INT8 (the head decides the token)
    mlp       the MLP's three linears only; attention and lm_head on INT8 (what QuantSpec's
              own code quantizes: its attention stays in 16 bits)

The sweep that measured them is `benchmarks/recipes.py` (docs/PERF.md); a registry model's
converted folder uses the recipe measured fastest for it (`RegistryModel.draft_recipe`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from qspec_core.errors import QspecError

MODULE_SETS = ("all", "no-head", "mlp")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Recipe:
    name: str
    method: str  # rtn | gptq | awq | int8-upper (the upper nibble of the INT8 weights)
    group_size: int | None  # None: `convert.default_group_size` (128, or 64 where 128 won't do)
    modules: str = "all"  # one of MODULE_SETS
    damp: float = 0.01  # GPTQ's damping, a fraction of the Hessian's mean diagonal
    about: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def selects(self, name: str) -> bool:
        """Whether the linear layer `name` ("layers.3.mlp.up_proj", "lm_head") gets a 4-bit
        twin."""
        if self.modules == "all":
            return True
        if self.modules == "no-head":
            return name != "lm_head"
        return name.endswith(_MLP)


RECIPES = {
    r.name: r
    for r in (
        Recipe("gptq", "gptq", None, about="GPTQ, default group, every linear"),
        Recipe("gptq-g32", "gptq", 32, about="GPTQ, group 32, every linear"),
        Recipe("gptq-g64", "gptq", 64, about="GPTQ, group 64, every linear"),
        Recipe("gptq-g128", "gptq", 128, about="GPTQ, group 128 (ragged where 128 won't divide)"),
        Recipe("gptq-damp10", "gptq", None, damp=0.1, about="GPTQ with 10% damping"),
        Recipe(
            "gptq-head8",
            "gptq",
            None,
            "no-head",
            about="GPTQ, lm_head drafts on INT8 (the default model's)",
        ),  # fmt: skip
        Recipe("gptq-mlp", "gptq", None, "mlp", about="GPTQ MLP only; attention, lm_head INT8"),
        Recipe("rtn", "rtn", None, about="round to nearest, default group, every linear"),
        Recipe("awq", "awq", None, about="AWQ, default group, every linear"),
        Recipe(
            "int8-upper",
            "int8-upper",
            None,
            about="hierarchical weights: the upper 4 bits of the INT8 verifier's weights",
        ),  # fmt: skip
    )
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise QspecError(f"unknown recipe {name!r} (have: {', '.join(RECIPES)})") from None
