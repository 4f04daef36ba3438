"""The hierarchical cache's planes back to fp32 rows on a CPU (`dequant.cpp`), bit for bit
what `kernels.planes.dequantize_keys` / `dequantize_values` compute (their twins in the
tests), in one pass and in place: a prefill chunk's attention reads the quantized history
this way (`qspec_core/cache/prefill.py`), 50-100x faster than the twins' dozen tensor ops.
"""

from __future__ import annotations

import torch

from kernels.cpu import build as cpu_ext
from kernels.planes import QuantizedGroupTensor, check_view, dequantize_keys, dequantize_values


def dequantize_into(
    planes: QuantizedGroupTensor, group_size: int, keys: bool, view: str, out: torch.Tensor
) -> torch.Tensor:
    """Write `planes` (keys per channel when `keys`, else values per token; [B, n, T, D/2]
    planes) in the KV view `view` ("int8" or "int4") into out [B, n, T, D] (rows contiguous);
    the C++ pass where it runs here, else the PyTorch twin and a copy. Returns out."""
    check_view(view)
    tensors = (planes.upper, planes.lower, planes.scale, planes.zero, out)
    if (
        all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
        and out.dtype == planes.scale.dtype == torch.float32
        and (keys or group_size % 2 == 0)
        and cpu_ext.available()
    ):
        cpu_ext.load().dequantize_planes_cpu(*tensors[:4], group_size, keys, view == "int8", out)
        return out
    twin = dequantize_keys if keys else dequantize_values
    return out.copy_(twin(planes, group_size, view))
