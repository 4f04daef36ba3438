"""Triton kernels (GPU, or TRITON_INTERPRET=1 on a CPU), in two halves so that a CPU run
never imports Triton (72 MB resident):

- the host modules here (`w4a16`, `w8a16`, `kv_pack`, `hier_attention`, and `runs`, what
  they share) import no Triton: each holds its PyTorch twin or the one it calls, the argument
  checks, `triton_usable` and the public entry points, which choose kernel or twin;
- `jit/`, one module of the same name per host module (plus `jit/common.py`, the jit helpers
  they share): the `@triton.jit` kernels and their launch, the only code that imports Triton.
  A host module imports its jit module inside `_jit()`, called when a kernel is about to run,
  or under TRITON_INTERPRET=1 on a CPU when `triton_usable` asks whether it was interpreted.
"""
