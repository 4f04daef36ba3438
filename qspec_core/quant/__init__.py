"""Quantized linear layers (4-bit draft, INT8 target) and the GPTQ/AWQ quantizers."""


def filled(layer, bias=None, **buffers):
    """`layer` with each named buffer copied in (and `bias` where given): how the quantized
    layers are made from their codes and scales (`Int4Linear` / `Int8Linear.from_quantized`)."""
    for name, value in buffers.items():
        getattr(layer, name).copy_(value)
    if bias is not None:
        layer.bias.copy_(bias)
    return layer
