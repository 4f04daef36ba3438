"""Quantized linear layers (4-bit draft, INT8 target) and the GPTQ/AWQ quantizers."""
