"""What the jit modules share: the bf16 rounding before a store, and whether a kernel was
built for the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


def interpreted(kernel) -> bool:
    """Whether `kernel` runs in Triton's interpreter: triton.jit chose so at decoration time,
    from TRITON_INTERPRET then (each jit module's INTERPRETED)."""
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def round_to_bf16_grid(value):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32.

    Triton's interpreter casts fp32 to bf16 by truncation, GPUs round to nearest even; rounding
    here first makes the final cast exact on both, so the interpreter tests what a GPU stores.
    NaN and inf keep their class; finite values past the bf16 range round to inf, as in torch.
    """
    bits = value.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(value != value, value, bits.to(tl.float32, bitcast=True))
