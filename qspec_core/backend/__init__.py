"""The CPU backend: decode and verify steps in qspec's C++ kernels."""
