"""W4A16 matmul: layout helpers, the PyTorch twin, and the Triton kernel under the interpreter.

conftest.py sets TRITON_INTERPRET=1 before any import, so `_launch` really runs Triton here.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.formats import pack_int4, unpack_int4
from kernels.triton import w4a16
from kernels.triton.w4a16 import _launch, w4a16_matmul, w4a16_ref

REPO = Path(__file__).resolve().parent.parent


def make_weights(n, k, group_size, dtype=torch.float32, seed=0):
    """Random q [N, K] in 0..15, positive scales and fractional zeros [N, K // G]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // group_size, generator=gen) * 0.1 + 0.01).to(dtype)
    zero = (torch.rand(n, k // group_size, generator=gen) * 15.0).to(dtype)  # fractional
    return q, scale, zero


def fp64_reference(x, q, scale, zero, group_size):
    """Dequantize the unpacked q and multiply, all in fp64 (independent of unpack_int4)."""
    scale_k = scale.double().repeat_interleave(group_size, dim=1)
    zero_k = zero.double().repeat_interleave(group_size, dim=1)
    weight = (q.double() - zero_k) * scale_k  # [N, K]
    return x.double() @ weight.T


# ---------------------------------------------------------------------------------------------
# Layout


def test_pack_layout_low_nibble_first():
    q = torch.tensor([[1, 2, 15, 0, 7, 9]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F, 0x97]]


@pytest.mark.parametrize("n,k", [(1, 2), (7, 64), (100, 256)])
def test_pack_unpack_round_trip(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    packed = pack_int4(q)
    assert packed.shape == (n, k // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[16, 0]], dtype=torch.uint8))
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# The PyTorch twin


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_ref_matches_dequantize_then_matmul(group_size):
    n, k = 40, 256
    q, scale, zero = make_weights(n, k, group_size)
    x = torch.randn(2, 5, k, generator=torch.Generator().manual_seed(2))
    y = w4a16_ref(x, pack_int4(q), scale, zero, group_size)
    assert y.shape == (2, 5, n) and y.dtype == x.dtype
    # per-element dequantization with explicit group indices, no repeat_interleave
    groups = torch.arange(k) // group_size
    weight = (q.float() - zero[:, groups]) * scale[:, groups]
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_ref_rejects_bad_shapes():
    q, scale, zero = make_weights(8, 64, 32)
    packed = pack_int4(q)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_ref(torch.randn(1, 64), packed, scale, zero, 0)
    with pytest.raises(ValueError, match="scale"):  # (any G: 16 here, but scales of G = 32)
        w4a16_ref(torch.randn(1, 64), packed, scale, zero, 16)
    with pytest.raises(ValueError, match="K"):
        w4a16_ref(torch.randn(1, 32), packed, scale, zero, 32)
    with pytest.raises(ValueError, match="scale"):
        w4a16_ref(torch.randn(1, 64), packed, scale[:, :1], zero, 32)


# ---------------------------------------------------------------------------------------------
# The Triton kernel (interpreter) against the twin, FlagAttention style


def assert_kernel_close(x, q, scale, zero, group_size):
    """max|triton - fp64| <= 2 * max|ref in x.dtype - fp64| + eps."""
    packed = pack_int4(q)
    exact = fp64_reference(x, q, scale, zero, group_size)
    ref = w4a16_ref(x, packed, scale, zero, group_size)
    out = _launch(x, packed, scale, zero, group_size)
    assert out.shape == ref.shape and out.dtype == x.dtype
    ref_err = (ref.double() - exact).abs().max().item()
    out_err = (out.double() - exact).abs().max().item()
    eps = 1e-6 * (1.0 + exact.abs().max().item())
    assert out_err <= 2 * ref_err + eps, f"triton err {out_err:.3g} vs ref err {ref_err:.3g}"


CASES = [(k, g) for k in (64, 128, 256) for g in (32, 64, 128) if g <= k]  # (K, G): 8 valid pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,group_size", CASES)
@pytest.mark.parametrize("n", [48, 64, 100])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_kernel_matches_reference(m, n, k, group_size, dtype):
    q, scale, zero = make_weights(n, k, group_size, dtype=dtype, seed=m * 1000 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m)).to(dtype)
    assert_kernel_close(x, q, scale, zero, group_size)


def test_kernel_odd_operands():
    """G = 256, fp32 scales with bf16 x, leading dims, a strided x, several M tiles, fp16."""
    q, scale, zero = make_weights(36, 512, 256, seed=5)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert_kernel_close(x, q, scale, zero, 256)  # fp32 scale/zero, bf16 x, [2, 3, K]

    q, scale, zero = make_weights(20, 64, 32, seed=7)
    wide = torch.randn(64, 70, generator=torch.Generator().manual_seed(8))
    assert_kernel_close(wide.T, q, scale, zero, 32)  # x [70, 64] with stride (1, 70): 2 M tiles

    q, scale, zero = make_weights(24, 128, 64, dtype=torch.float16, seed=9)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(10)).half()
    assert_kernel_close(x, q, scale, zero, 64)


# ---------------------------------------------------------------------------------------------
# The wrapper's dispatch


def test_wrapper_runs_triton_under_interpreter(monkeypatch, spy):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = spy(w4a16, "_launch")
    q, scale, zero = make_weights(48, 128, 64)
    x = torch.randn(3, 128)
    y = w4a16_matmul(x, pack_int4(q), scale, zero, 64)
    assert calls == ["_launch"]
    torch.testing.assert_close(y, w4a16_ref(x, pack_int4(q), scale, zero, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wrapper_falls_back_on_cpu(monkeypatch, dtype):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(w4a16, "_launch", lambda *a: pytest.fail("Triton ran without a driver"))
    q, scale, zero = make_weights(100, 256, 128, dtype=dtype)
    x = torch.randn(2, 4, 256).to(dtype)
    assert not w4a16.triton_usable(x)
    y = w4a16_matmul(x, pack_int4(q), scale, zero, 128)
    assert torch.equal(y, w4a16_ref(x, pack_int4(q), scale, zero, 128))


def test_wrapper_without_interpreter_in_fresh_process():
    """Imported with TRITON_INTERPRET unset, the wrapper must still work on CPU through the
    twin, never reaching Triton's driver check, nor importing Triton (`kernels.triton.jit`)."""
    code = (
        "import sys\n"
        "import torch\n"
        "from kernels.formats import pack_int4\n"
        "from kernels.triton.w4a16 import w4a16_matmul, w4a16_ref\n"
        "q = torch.randint(0, 16, (64, 128), dtype=torch.uint8)\n"
        "s, z = torch.rand(64, 2), torch.rand(64, 2) * 15\n"
        "x = torch.randn(1, 128).bfloat16()\n"
        "p = pack_int4(q)\n"
        "assert torch.equal(w4a16_matmul(x, p, s, z, 64), w4a16_ref(x, p, s, z, 64))\n"
        "assert 'triton' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
