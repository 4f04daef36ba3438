"""Batch invariance of the target path: a token's logits inside a verify of M tokens are bit for
bit those of the same token decoded alone. Greedy QuantSpec equals target-ar only because of
this; PyTorch's GEMMs (bf16, int8) pick other kernels and reduction orders for M = 1 and
M = 5 on AVX-512 machines, which flipped a near tie in a real summary."""

import platform

import pytest
import torch
from hf_tiny import ours_from_hf, tiny_hf

from kernels.cpu import build as cpu_ext
from kernels.cpu import linear as cpu_linear
from kernels.formats import quantize_int8
from qspec_core.cache.hierarchical import HierarchicalKVCache
from qspec_core.engine.generate import prefill
from qspec_core.model.transformer import attach_int8, linear_layers
from qspec_core.precision import TARGET
from qspec_core.quant.int8 import Int8Linear
from qspec_core.runner import CpuRunner, build_runner

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="no C++ compiler here")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _bound(x64, w64, K):
    """Deterministic fp32 dot-product error bound: |fl(x.w) - x.w| <= K u sum|x||w| (u =
    2^-24), plus the final rounding of y; the kernel must stay inside it."""
    return (K + 2) * 2.0**-24 * (x64.abs() @ w64.abs().T) + 1e-30


@pytest.mark.parametrize("wdtype", ["fp32", "bf16", "fp16", "int8"])
@pytest.mark.parametrize("K,N", [(64, 40), (200, 33), (576, 96)])
def test_step_linears_are_batch_invariant_and_within_the_fp32_bound(wdtype, K, N):
    g = _gen(K + N)
    x = torch.randn(17, K, generator=g)
    bias = torch.randn(N, generator=g)
    dense = torch.randn(N, K, generator=g) * 0.1
    if wdtype == "int8":
        q, scale = quantize_int8(dense)

        def run(rows):
            return cpu_linear.int8_linear(rows, q, scale, bias)

        w64 = q.double() * scale.double()[:, None]
    else:
        w = dense.to(DTYPES[wdtype])

        def run(rows):
            return cpu_linear.linear(rows, w, bias)

        w64 = w.double()
    whole = run(x)
    for M in (1, 2, 5, 8, 9, 17):  # every block shape of the kernel, and past one block
        part = run(x[:M])
        assert torch.equal(part, whole[:M]), M
    for m in range(17):  # a row alone gives its bits inside any batch
        assert torch.equal(run(x[m : m + 1])[0], whole[m]), m
    exact = x.double() @ w64.T + bias.double()
    err = (whole.double() - exact).abs()
    assert (err <= _bound(x.double(), w64, K) + 2.0**-24 * bias.double().abs()).all()


@pytest.mark.parametrize("K,N", [(64, 40), (576, 96), (1536, 23)])
def test_w8a8_step_linear_is_batch_invariant_and_exact_in_its_integers(K, N):
    """W8A8 (`int_dot.cpp`): every row's bits are the same alone and inside any block shape,
    and the result is the exact integer dot per 64 inputs times the steps, to fp32 rounding of
    the few float operations per chunk (nothing like K ulps of an fp32 dot)."""
    g = _gen(K * 7 + N)
    x = torch.randn(17, K, generator=g) * torch.logspace(-3, 2, K)  # chunks of every scale
    x[3, :64] = 0  # an all-zero chunk: step 0
    q, scale = quantize_int8(torch.randn(N, K, generator=g) * 0.1)
    q[0, :64] = -128  # the most negative code, which the unsigned-weight trick must survive
    bias = torch.randn(N, generator=g)

    def run(rows):
        return cpu_linear.w8a8_linear(rows, q, scale, bias)

    whole = run(x)
    for M in (1, 2, 3, 5, 8, 9, 12, 17):
        assert torch.equal(run(x[:M]), whole[:M]), M
    for m in range(17):
        assert torch.equal(run(x[m : m + 1])[0], whole[m]), m
    # exact: int64 dots per chunk, steps and scales in float64
    chunks = x.reshape(17, -1, 64)
    amax = chunks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # (one division)
    codes = torch.round(chunks * inv).long()
    dots = torch.einsum("mck,nck->mnc", codes, q.long().reshape(N, -1, 64))
    step = (amax / 127.0).double()[..., 0]  # [17, C], as the kernel rounds it (fp32)
    exact = (dots.double() * step[:, None, :]).sum(-1) * scale.double() + bias.double()
    # fp32 roundings on the way: the step, one multiply-add per chunk, four in the 16-lane sum
    # of partial dots, the scale, the bias: (C + 8) u of the sum of |products| (u = 2^-24)
    adots = torch.einsum("mck,nck->mnc", codes.abs(), q.long().abs().reshape(N, -1, 64))
    terms = (adots.double() * step[:, None, :]).sum(-1) * scale.double()
    bound = (K // 64 + 8) * 2.0**-24 * terms + 2.0**-24 * bias.double().abs()
    assert ((whole.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("K,N", [(64, 40), (576, 37), (1536, 200)])
def test_w8a8_prefill_rows_are_their_definition_whatever_the_rows_and_threads(K, N):
    """A prefill's W8A8 product (more than MAX_STEP_ROWS rows, `int_gemm.h`): on x86 (AVX2's int16
    products, AVX-VNNI's and AVX-512 VNNI's vpdpbusd) `w8a8_prefill_ref` bit for bit (each
    chunk's exact integer dot, one fp32 multiply-add a chunk), so the same bits on every x86
    build, the same for a row in any call of many rows, at one thread or two, tails of outputs
    and rows included; elsewhere (NEON, portable) a decode step's bits for every row."""
    x86_vector = platform.machine() in ("x86_64", "AMD64") and cpu_ext.isa() != "generic"
    assert cpu_linear.prefill_lanes() == x86_vector
    g = _gen(K * 3 + N)
    x = torch.randn(300, K, generator=g) * torch.logspace(-3, 2, K)  # chunks of every scale
    x[3, :64] = 0  # an all-zero chunk: step 0
    q, scale = quantize_int8(torch.randn(N, K, generator=g) * 0.1)
    q[0, :64] = -128  # the most negative code: the unsigned-weight trick must survive it
    bias = torch.randn(N, generator=g)
    whole = cpu_linear.w8a8_linear(x, q, scale, bias)
    if cpu_linear.prefill_lanes():
        assert torch.equal(whole, cpu_linear.w8a8_prefill_ref(x, q, scale, bias))
        assert torch.equal(
            cpu_linear.w8a8_linear(x, q, scale, None), cpu_linear.w8a8_prefill_ref(x, q, scale)
        )
        steps = torch.cat([cpu_linear.w8a8_linear(x[m : m + 1], q, scale, bias) for m in range(8)])
        torch.testing.assert_close(whole[:8], steps, rtol=1e-5, atol=1e-5 * steps.abs().max())
    else:
        for m in range(0, 300, 37):
            assert torch.equal(whole[m], cpu_linear.w8a8_linear(x[m : m + 1], q, scale, bias)[0])
    for a, b in ((0, 18), (5, 31), (131, 300), (17, 150)):  # other calls, other tiles
        assert torch.equal(cpu_linear.w8a8_linear(x[a:b], q, scale, bias), whole[a:b]), (a, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.w8a8_linear(x, q, scale, bias), whole)
    finally:
        torch.set_num_threads(threads)


def test_step_linears_take_low_precision_activations_exactly():
    """bf16 activations are upcast exactly; the result is rounded once to bf16."""
    g = _gen(3)
    x = torch.randn(5, 96, generator=g).bfloat16()
    w = torch.randn(48, 96, generator=g).bfloat16()
    got = cpu_linear.linear(x, w, None)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_linear.linear(x.float(), w, None).bfloat16())


def _tiny_model(dtype: torch.dtype, weights: str):
    # head_dim 64: the CPU attention kernel's vectorized path (16 would take the portable one);
    # w8a8 needs every linear's inputs in whole 64-input chunks
    hf = tiny_hf(
        "llama",
        **({"intermediate_size": 192} if weights == "w8a8" else {}),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=3,
        max_position_embeddings=512,
    )
    model = ours_from_hf(hf)
    if weights in ("int8", "w8a8"):
        attach_int8(
            model, {n: Int8Linear.from_linear(layer) for n, layer in linear_layers(model).items()}
        )
    return model.to(dtype)


@pytest.mark.parametrize("weights", ["full", "int8", "w8a8"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_verify_logits_equal_one_token_at_a_time(dtype, weights):
    """The target path over M tokens in one forward == the same tokens fed one by one, bit
    for bit, for every dtype and target weights qspec offers; M up to gamma + 1 = MAX_STEP_ROWS."""
    torch.manual_seed(0)
    model = build_runner(_tiny_model(DTYPES[dtype], weights))  # what qspec runs the model with
    assert isinstance(model, CpuRunner)
    path = TARGET.with_weights(weights)
    G = model.config.head_dim

    # 157 = 64 quantized + 93 in the full-precision region: its last block of keys is ragged
    # (not a multiple of 8) and a verify makes it longer than a single step does
    n = 157
    prompt = torch.randint(0, 101, (n,), generator=_gen(4)).tolist()

    def fresh():
        cache = HierarchicalKVCache(model.config, 256, dtype=model.dtype)
        with torch.no_grad():
            prefill(model, cache, prompt, 0, path, chunk_size=G)
        cache.commit(n)
        return cache

    tokens = torch.randint(0, 101, (17,), generator=_gen(5)).tolist()
    for M in (2, 5, 9, 17):
        batched, single = fresh(), fresh()
        assert batched.quantized_len == 64
        with torch.no_grad():
            pos = torch.arange(n, n + M)
            together = model(torch.tensor([tokens[:M]]), pos, batched, path)[0]
            alone = torch.cat(
                [
                    model(torch.tensor([[t]]), torch.tensor([n + i]), single, path)[0]
                    for i, t in enumerate(tokens[:M])
                ]
            )
        assert torch.equal(together, alone), (dtype, weights, M)


def test_w8a8_prefill_of_several_weights_is_each_product_alone():
    """`w8a8_prefill` (a layer's q, k, v in one call: x rounded once, the products' slabs in
    one parallel region) gives each weight's `w8a8_linear` bit for bit: tails of outputs (N
    not a multiple of the 32-output slab, N = 0), no bias, an fp32 one and a bf16 one (which
    the call converts and must keep alive), at one thread or two."""
    g = _gen(7)
    x = torch.randn(1, 150, 576, generator=g)
    weights = []
    for n, bias in (
        (576, None),
        (192, torch.float32),
        (0, None),
        (37, None),
        (200, torch.bfloat16),
    ):
        q, scale = quantize_int8(torch.randn(n, 576, generator=g) * 0.1)  # (n = 0: no output)
        weights.append((q, scale, None if bias is None else torch.randn(n, generator=g).to(bias)))
    threads = torch.get_num_threads()
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            outs = cpu_linear.w8a8_prefill(x, weights)
            assert [o.shape for o in outs] == [(1, 150, w[0].shape[0]) for w in weights]
            for out, w in zip(outs, weights, strict=True):
                assert torch.equal(out, cpu_linear.w8a8_linear(x, *w))
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="more than a step"):
        cpu_linear.w8a8_prefill(x[:, :17], weights)
