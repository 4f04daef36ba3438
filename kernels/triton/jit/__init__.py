"""The `@triton.jit` kernels and their launch, one module per host module of `kernels.triton`
(which imports it only when a kernel runs); `common.py`, the jit helpers they share. Every
module here imports Triton; nothing outside `kernels.triton` imports them."""
