"""Flash-decoding attention over the hierarchical INT4/INT8 KV cache in Triton (QuantSpec,
design sec. 5).

Arguments (q, view, rows, kv, chunk_size), as for its twin `kernels.reference.
hier_attention_ref` and the C++ kernel: q [B, H, T, D]; `view` one layer of the cache as
stored (`kernels.planes.HierLayerView`: nibble planes, fp32 metadata, the full-precision
region at positions fp_pos0..); `rows` which keys each query sees (`kernels.planes.QueryRows`:
history j < n_quant_q[t], full-precision key j with fp_lo[t] <= j and fp_pos0 + j <=
input_pos[t]); `kv` "int4" reads the upper plane only (U * s + zero), "int8" both
((16 U + L) * (s / 16) + zero), exactly as `kernels.planes.dequantize_keys/values`.

`hier_attention_triton` runs the kernels (no fallback: `kernels.attention.hier_attention`
chooses between this, the C++ kernel and the twin); `hier_attention_launcher` does the host
work once and returns a launch-only closure (CUDA-graph capturable). The kernels and their
launch are `kernels.triton.jit.hier_attention`, imported only when they run.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.planes import HierLayerView, QueryRows
from kernels.triton.runs import kernel_runs_on


def _jit() -> ModuleType:
    """The kernels' module, imported (with Triton) on first use."""
    from kernels.triton.jit import hier_attention

    return hier_attention


def hier_attention_launcher(
    q: torch.Tensor,
    view: HierLayerView,
    rows: QueryRows,
    kv: str,
    chunk_size: int | None = None,
    dot_precision: str | None = None,
    softcap: float | None = None,
):
    """Do the host-side work of one Triton call once and return `run() -> out`, which only
    launches the two kernels (no host sync, no allocation: CUDA-graph capturable).

    `run` reads the current contents of the view's tensors (if none had to be copied to a
    row-major layout) into the same output buffer each time; the rows and lengths are fixed.
    `chunk_size`: history tokens per program (rounded up to the key tile; default: sized to
    fill the GPU). `dot_precision` overrides the tl.dot input precision ("tf32" on CUDA,
    "ieee" for checks). `softcap`: Gemma 2's attn_logit_softcapping (None: none). Pass the
    rows on the CPU to avoid a device sync (the grid size needs max(n_quant_q) on the host).
    """
    view.check(q, kv)
    if rows.parents is not None:  # (`kernels.attention` sends a tree's rows to the reference)
        raise ValueError("the Triton kernel reads chains of queries, not a token tree's")
    D = q.shape[-1]
    if D & (D - 1) or D < 16:
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim >= 16, got {D}")
    return _jit().launcher(q, view, rows, kv, chunk_size, dot_precision, softcap)


def hier_attention_triton(*args, **kwargs) -> torch.Tensor:
    """One Triton call: attention over the hierarchical cache -> [B, H, T, D] in q's dtype.
    `hier_attention_launcher` run once: its arguments, passed through (one parameter list)."""
    return hier_attention_launcher(*args, **kwargs)()


def triton_usable(q: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for q: on CUDA, or on CPU when the interpreter is on
    (now, and when its jit module was imported: triton.jit chooses at decoration time), with a
    power-of-two head_dim >= 16 (its tiles)."""
    D = q.shape[-1]
    return kernel_runs_on(_jit, q) and D >= 16 and D & (D - 1) == 0
