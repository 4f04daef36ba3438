"""Triton kernels (GPU, or TRITON_INTERPRET=1 on a CPU)."""
