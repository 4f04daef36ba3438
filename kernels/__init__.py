"""Attention and matmul kernels (Triton) beside their pure-PyTorch twins (`reference.py`)."""
