"""qspec's C++ CPU kernels, built once per instruction set, and their Python wrappers."""
