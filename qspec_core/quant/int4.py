"""W4A16 linear layers for the draft path: packed int4 weights with group scales and zeros.

    w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G],  q in 0..15

Storage (the converted model's `draft.safetensors`): `packed` uint8 [N, Kp/2] (two nibbles
per byte along K, even k in the low nibble), `scale` and `zero` fp32 [N, Kp/G]. Kp is K
rounded up to whole groups: GPTQ allows a group size that does not divide K (group size 128
over 576 inputs: five groups, the last one of 64), and such a layer is stored padded, its
input padded with zeros (so the padded columns add exactly nothing). The matmul
never builds the dense weight on the fast paths: on CUDA the Triton kernel
(`kernels/triton/w4a16.py`) dequantizes in registers; on CPU PyTorch's int4 weight kernel runs with
bf16 activations (its blocked weight layout is ISA-specific, so it is never stored: the
runner that runs the layer makes it once and keeps it, `CpuLayouts`). Shapes those kernels
cannot take use `w4a16_ref`, which is exact but slow.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.formats import dequantize_int4 as dequantize
from kernels.formats import pack_int4, unpack_int4
from kernels.triton.w4a16 import w4a16_matmul, w4a16_ref
from qspec_core.quant import filled

CPU_INT4_GROUPS = (32, 64, 128, 256)


def n_groups(in_features: int, group_size: int) -> int:
    """Groups of `group_size` inputs over `in_features`, the last one possibly short."""
    return -(-in_features // group_size)


def rtn_quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric round-to-nearest 4-bit: weight [N, K] -> q uint8 [N, K], scale and zero fp32
    [N, ceil(K/G)] (a short last group when G does not divide K).

    Integer zero points (0..15), as GPTQ/AWQ checkpoints store them, so any RTN draft can be
    exported as a standard GPTQ checkpoint.
    """
    N, K = weight.shape
    groups = n_groups(K, group_size)
    # (zero padding changes no group's grid: every grid spans 0 already)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group_size - K))
    w = w.reshape(N, groups, group_size)
    lo = w.amin(-1).clamp(max=0.0)  # the grid must contain 0 so that zero is representable
    hi = w.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(N, -1)[:, :K].to(torch.uint8), scale, zero


class Int4Linear(nn.Module):
    """A linear layer whose weight is 4-bit (W4A16). Buffers: packed, scale, zero (+ bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool = False,
        permuted: bool = False,
        scaled: bool = False,
    ):
        super().__init__()
        if group_size < 1 or group_size % 2 or in_features % 2:
            raise ValueError(
                f"in_features {in_features} and group size {group_size} must be even (and >= 2)"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = n_groups(in_features, group_size)
        self.padded_features = groups * group_size  # Kp: whole groups (the stored width)
        self.register_buffer(
            "packed", torch.zeros(out_features, self.padded_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("scale", torch.zeros(out_features, groups))
        self.register_buffer("zero", torch.zeros(out_features, groups))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        # Act-order (desc_act) GPTQ: input channels are stored sorted by group, so groups stay
        # contiguous; the forward gathers x in the same order (x[..., perm]).
        self.register_buffer("perm", torch.arange(in_features) if permuted else None)
        # Activation-aware (AWQ) scaling kept explicit, since the draft shares its norms with
        # the target: y = (W' (x * input_scale)) * output_scale.
        self.register_buffer("input_scale", torch.ones(in_features) if scaled else None)
        self.register_buffer("output_scale", torch.ones(out_features) if scaled else None)

    @classmethod
    def from_quantized(cls, q, scale, zero, group_size, bias=None) -> Int4Linear:
        """From unpacked q uint8 [N, K] and fp32 scale/zero [N, ceil(K/G)]."""
        N, K = q.shape
        layer = cls(K, N, group_size, bias is not None)
        packed = pack_int4(layer._padded(q, zero))
        return filled(layer, bias, packed=packed, scale=scale, zero=zero)

    @classmethod
    def from_int4_weight(cls, w, bias=None) -> Int4Linear:
        """From a checkpoint's `Int4Weight` (GPTQ/AWQ import), act-order included."""
        N, K = w.q.shape
        G = w.group_size
        if w.g_idx is None or bool((w.g_idx == torch.arange(K) // G).all()):
            return cls.from_quantized(w.q, w.scale, w.zero, G, bias)
        perm = torch.argsort(w.g_idx.long(), stable=True)  # channels grouped by group index
        groups = n_groups(K, G)
        counts = torch.bincount(w.g_idx.long(), minlength=groups)
        expected = torch.full((groups,), G)
        expected[-1] = K - (groups - 1) * G  # (the short last group, when G does not divide K)
        if not torch.equal(counts, expected):
            raise ValueError("g_idx does not assign exactly group_size channels to each group")
        layer = cls(K, N, G, bias is not None, permuted=True)
        layer.packed.copy_(pack_int4(layer._padded(w.q[:, perm], w.zero)))
        layer.scale.copy_(w.scale)
        layer.zero.copy_(w.zero)
        layer.perm.copy_(perm)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer

    @classmethod
    def from_int8_upper(cls, w_int8, scale, bias=None, group_size: int = 64) -> Int4Linear:
        """The upper 4 bits of INT8 weights as a draft (hierarchical weights, issue 19).

        w_int8 [N, K] int8 with per-row fp32 scale [N]: w = scale * w8 and, splitting the
        byte, w8 = 16 * hi + lo with hi = w8 >> 4 in -8..7 and lo in 0..15 (two's complement).
        Reading hi alone, lo is unknown; its mean 7.5 keeps the rounding unbiased:
        w ~ 16 scale (hi + 7.5 / 16), i.e. q = hi + 8 with zero 8 - 7.5 / 16 and scale
        16 scale, repeated over groups of `group_size` (a per-row grid in the group layout the
        kernels take; G = K where `group_size` does not divide K)."""
        N, K = w_int8.shape
        G = group_size if K % group_size == 0 else K
        q = (w_int8.to(torch.int16) >> 4) + 8  # (arithmetic shift: floor(w8 / 16))
        groups = K // G
        step = (16 * scale.float())[:, None].expand(N, groups).contiguous()
        zero = torch.full((N, groups), 8 - 7.5 / 16)
        return cls.from_quantized(q.to(torch.uint8), step, zero, G, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        """Round-to-nearest quantization of an existing linear layer."""
        q, scale, zero = rtn_quantize(linear.weight.data, group_size)
        bias = None if linear.bias is None else linear.bias.data.float()
        return cls.from_quantized(q, scale, zero, group_size, bias)

    @property
    def ragged(self) -> bool:
        """Whether the group size does not divide in_features (stored padded)."""
        return self.padded_features != self.in_features

    def _padded(self, q: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """q [N, K] -> [N, Kp]: the padding holds the last group's zero point (a zero weight;
        the padded inputs are zero anyway)."""
        pad = self.padded_features - q.shape[1]
        if not pad:
            return q
        fill = zero[:, -1:].round().clamp(0, 15).to(torch.uint8).expand(-1, pad)
        return torch.cat([q, fill], dim=1)

    def unpacked(self) -> torch.Tensor:
        """q uint8 [N, K] in storage order (the padding dropped)."""
        return unpack_int4(self.packed)[:, : self.in_features]

    def dequantized(self) -> torch.Tensor:
        """The dense fp32 weight [N, K] this layer represents (for reports and tests)."""
        w = dequantize(unpack_int4(self.packed), self.scale, self.zero)[:, : self.in_features]
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm, w)  # back to input order

    def cpu_kernel_ok(self) -> bool:
        return self.group_size in CPU_INT4_GROUPS and self.out_features % 16 == 0

    def cpu_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int4pack, scale_and_zero): the weights in the blocked layout of PyTorch's CPU int4
        kernel (ISA-specific, so made where it runs, never stored). Made anew on every call:
        whoever runs the layer more than once keeps it (a runner's `CpuLayouts`)."""
        q = unpack_int4(self.packed).to(torch.int32)  # [N, Kp] in 0..15
        int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        # The kernel computes (q - 8) * s + z_f: with an integer zero point z that is
        # (q - z) * s when z_f = (8 - z) * s.
        scale_and_zero = torch.stack(
            [self.scale.t(), ((8 - self.zero) * self.scale).t()], dim=-1
        ).to(torch.bfloat16)  # [K/G, N, 2]
        return int4pack, scale_and_zero.contiguous()

    def effective_weight(self) -> torch.Tensor:
        """The dense fp32 weight [N, K] the layer applies, scales included."""
        w = self.dequantized()
        if self.input_scale is not None:
            w = w * self.input_scale[None, :] * self.output_scale[:, None]
        return w

    def rows(self, ids: torch.Tensor) -> Int4Linear:
        """The layer of output rows `ids` only (a draft's slice of the vocabulary): each row's
        codes, scales and zero points, so y[..., i] = self(x)[..., ids[i]]."""
        layer = Int4Linear(
            self.in_features,
            len(ids),
            self.group_size,
            self.bias is not None,
            self.perm is not None,
            self.input_scale is not None,
        )
        per_row = ("packed", "scale", "zero", "bias", "output_scale")
        for name, value in self._buffers.items():
            if value is not None:
                getattr(layer, name).copy_(value[ids] if name in per_row else value)
        return layer

    def with_scales(self, input_scale=None, output_scale=None) -> Int4Linear:
        """A copy carrying explicit input/output channel scales (AWQ)."""
        layer = Int4Linear(
            self.in_features,
            self.out_features,
            self.group_size,
            self.bias is not None,
            self.perm is not None,
            scaled=True,
        )
        state = dict(self.state_dict())
        state["input_scale"] = (
            torch.ones(self.in_features) if input_scale is None else input_scale.float()
        )
        state["output_scale"] = (
            torch.ones(self.out_features) if output_scale is None else output_scale.float()
        )
        layer.load_state_dict(state)
        return layer

    def w4a8_args(self):
        """(packed, scale, zero, group size) for the CPU runner's W4A8 kernel of a draft step,
        or False when this layer's form needs its own forward (AWQ scales, act-order, groups
        that are not multiples of 64). Read from the buffers on every call (dict reads)."""
        buffers = self._buffers  # (nn.Module.__getattr__ is slow: this runs once per linear)
        plain = buffers["input_scale"] is None and buffers["perm"] is None
        plain = plain and buffers["output_scale"] is None
        ok = plain and not self.in_features % 64 and not self.group_size % 64
        ok = ok and not self.ragged  # (the kernel reads x as wide as the stored weights)
        if not ok:
            return False
        return buffers["packed"], buffers["scale"], buffers["zero"], self.group_size

    def forward(self, x: torch.Tensor, cpu_layout=None) -> torch.Tensor:
        """x [..., K] -> [..., N]: the Triton kernel on CUDA, PyTorch's int4 kernel on CPU
        (bf16 activations; `cpu_layout`: this layer's `cpu_layout()` kept by the caller, else
        made for this call), else the exact reference. (A CPU decode step's W4A8 kernel is the
        CPU runner's choice: `qspec_core/runner/kernel_table.py`.)"""
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.ragged:
            x = torch.nn.functional.pad(x, (0, self.padded_features - self.in_features))
        if x.is_cuda:
            y = w4a16_matmul(
                x, self.packed, self.scale.to(x.dtype), self.zero.to(x.dtype), self.group_size
            )
        elif self.cpu_kernel_ok():
            int4pack, scale_and_zero = self.cpu_layout() if cpu_layout is None else cpu_layout
            x2 = x.reshape(-1, self.padded_features).to(torch.bfloat16)  # fast only in bf16
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, int4pack, self.group_size, scale_and_zero
            )
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        else:
            y = w4a16_ref(x, self.packed, self.scale, self.zero, self.group_size)
        if self.output_scale is not None:
            y = y * self.output_scale.to(y.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class CpuLayouts:
    """The CPU int4 kernel's weight layouts (`Int4Linear.cpu_layout`) of the 4-bit layers one
    runner runs, made on a layer's first use and dropped by `clear` (the runner's `rebuild`,
    after the model's tensors are replaced). Owned by the runner, so a model holds nothing
    beside its buffers."""

    def __init__(self):
        self._made: dict[Int4Linear, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, layer: Int4Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`layer.cpu_layout()`, made once; None where the CPU kernel does not take the layer."""
        layout = self._made.get(layer)
        if layout is None:
            if not layer.cpu_kernel_ok():
                return None
            layout = self._made[layer] = layer.cpu_layout()
        return layout

    def clear(self) -> None:
        self._made.clear()
