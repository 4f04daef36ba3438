"""`qspec bench`: parsing and refusals, interleaving, pair-wise speedups, the report's schema and
its internal consistency (tiny model), and a short real-model smoke run."""

import copy
import json
import statistics

import pytest
import torch
from test_cli import assert_user_error, run_qspec

from qspec_core.bench.bandwidth import path_weight_bytes, probe_buffer, read_bandwidth
from qspec_core.bench.runner import (
    MODES,
    BenchConfig,
    check_config,
    parse_contexts,
    parse_modes,
    run_bench,
    summarize_mode,
)
from qspec_core.errors import QspecError
from qspec_core.model.transformer import linear_layers
from qspec_core.registry.runtime import load_runtime
from qspec_core.runner.layouts import WeightLayouts

MODE_KEYS = {
    "about", "target_weights", "prompt_tokens", "new_tokens", "prefill_tokens_per_s", "ttft_s",
    "decode_tokens_per_s", "ms_per_token", "kv_bytes_per_token", "kv_cache_bytes",
    "peak_memory_bytes", "speedup_vs_ar", "stages", "runs",
}  # fmt: skip


def test_parse_contexts():
    assert parse_contexts("2k,8k,32k") == [2048, 8192, 32768]
    assert parse_contexts(" 1.5K, 300 ") == [1536, 300]
    for bad in ("", "abc", "0", "-2k", "1.0001k", "2k,,x", "2k,", "2k,,8k", ","):
        with pytest.raises(QspecError, match="--context"):
            parse_contexts(bad)


def test_parse_modes():
    # the default: every mode but the opt-in ones (the checkpoint's weights, no trees)
    opt_in = ("-full", "-chain")
    assert parse_modes(None) == tuple(m for m in MODES if not m.endswith(opt_in))
    assert "quantspec-full" in MODES and parse_modes("quantspec-full") == ("quantspec-full",)
    assert parse_modes("quantspec-chain") == ("quantspec-chain",)
    assert parse_modes("ar,quantspec,ar") == ("ar", "quantspec")
    with pytest.raises(QspecError, match="unknown nope"):
        parse_modes("ar,nope")
    for bad in ("", "ar,", "ar,,quantspec"):
        with pytest.raises(QspecError, match="--modes"):
            parse_modes(bad)


@pytest.fixture(scope="module")
def tiny_runtime(tiny_model_dir):
    return load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None)


def test_refusals_name_the_limit_and_the_way_out(tiny_runtime):
    with pytest.raises(QspecError, match="beyond .* context of 512 tokens") as e:
        check_config(BenchConfig(contexts=[256, 1024], gen=8), tiny_runtime)
    assert "qwen2.5-coder-0.5b" in str(e.value) and "1024" in str(e.value)
    with pytest.raises(QspecError, match="fewer than 64 prompt tokens"):
        check_config(BenchConfig(contexts=[100], gen=64), tiny_runtime)


def test_tiny_bench_interleaves_and_reports_consistent_numbers(tiny_runtime):
    modes = tuple(MODES)
    config = BenchConfig(contexts=[192, 320], gen=12, modes=modes, repeats=2, gamma=3)
    labels = []
    report = run_bench(tiny_runtime, config, "fp32", on_run=labels.append)
    measured = [x for x in labels if not x.startswith("warm-up")]
    expected = [f"{c} {m} #{r}" for c in (192, 320) for r in (1, 2) for m in modes]
    assert measured == expected  # A B C ... A B C ..., per context
    assert [c["context"] for c in report["contexts"]] == [192, 320]
    assert json.loads(json.dumps(report)) == report  # plain JSON
    for ctx in report["contexts"]:
        assert ctx["prompt_tokens"] <= ctx["context"] - config.gen
        assert ctx["prompt_tokens"] >= ctx["context"] - config.gen - 4
        for name, r in ctx["modes"].items():
            assert MODE_KEYS <= r.keys(), name
            assert r["new_tokens"] == config.gen  # stop tokens ignored
            runs = r["runs"]
            assert len(runs) == 2
            ar = ctx["modes"]["ar"]["runs"]
            ratios = [
                ((x["new_tokens"] - 1) / x["decode_s"]) / ((a["new_tokens"] - 1) / a["decode_s"])
                for x, a in zip(runs, ar, strict=True)
            ]
            assert r["speedup_vs_ar"]["median"] == pytest.approx(statistics.median(ratios))
            rates = [(x["new_tokens"] - 1) / x["decode_s"] for x in runs]
            assert r["decode_tokens_per_s"]["min"] == pytest.approx(min(rates))
            assert sum(s["share"] for s in r["stages"].values()) == pytest.approx(1, abs=0.02)
            assert r["target_weights"] == ("int8" if name in ("ar-w8", "quantspec-w8verify")
                                           else "full")  # fmt: skip
            if MODES[name].speculative:
                spec = r["spec"]
                emitted = spec["accepted"] + spec["recovered"] + spec["bonus"]
                assert spec["tokens_per_target_step"] == pytest.approx(
                    emitted / spec["rounds"], abs=1e-4
                )
                # every token after each run's first comes from a round; a run's last round
                # may cut its final token at the limit
                after_first = sum(x["new_tokens"] - 1 for x in runs)
                assert after_first <= emitted <= after_first + len(runs)
                assert spec["drafted"] >= spec["accepted"]
                assert set(r["kv_bytes_per_token"]) == {"draft", "target"}
                assert r["stages"].keys() >= {"draft", "verify", "accept"}
            else:
                assert "spec" not in r and set(r["stages"]) == {"decode"}
            # the steps against the memory limit: each step kind, its bytes and its share
            kinds = {"draft", "verify"} if MODES[name].speculative else {"decode"}
            assert set(r["steps"]) == kinds, name
            for s in r["steps"].values():
                assert s["steps"] > 0 and s["ms"] > 0 and s["mb_read"] > 0
                assert s["fraction_of_bandwidth"] == pytest.approx(
                    s["mb_read"] * 1e6 / (s["ms"] / 1000) / (report["read_bandwidth_gb_s"] * 1e9),
                    rel=0.01,
                    abs=6e-5,  # (the report rounds it to 4 decimals: a slow step's is 0.0015)
                )
            # the prefill against the compute limit: its FLOPs over its median run's time, and
            # each stage of that run (attention, quantization, the rest: the linears)
            c = r["prefill_compute"]
            median = sorted(runs, key=lambda x: x["prefill_s"])[(len(runs) - 1) // 2]
            prefill_s = median["prefill_s"]
            assert c["gflop"] == pytest.approx(c["gflop_linears"] + c["gflop_attention"], 1e-3)
            assert c["gflop_s"] == pytest.approx(c["gflop"] / prefill_s, rel=1e-3)
            best = max(v for v in report["gemm_peak_gflop_s"].values() if v)
            assert c["fraction_of_peak"] == pytest.approx(c["gflop_s"] / best, rel=0.01)
            stages = median["prefill_stages_s"]
            hierarchical = MODES[name].target.kv != "fp"
            clocked = getattr(tiny_runtime.runner, "linear_seconds", None) is not None
            timed = {"attention"} | ({"quantize"} if hierarchical else set())
            assert set(stages) == timed | ({"linears"} if clocked else set())
            assert 0 < stages["attention"] < prefill_s
            if clocked:  # (the CPU runner times its layer loop's linears)
                assert 0 < stages["linears"] < prefill_s - stages["attention"]
                assert c["linears_s"] == pytest.approx(stages["linears"], rel=1e-3)
            parts = c["attention_s"] + c["linears_s"] + c["quantize_s"] + c.get("other_s", 0)
            assert parts == pytest.approx(prefill_s, rel=1e-3, abs=1e-4)
            assert c["linears_gflop_s"] == pytest.approx(
                c["gflop_linears"] / c["linears_s"], rel=2e-3
            )
            assert c["attention_gflop_s"] == pytest.approx(
                c["gflop_attention"] / c["attention_s"], rel=2e-3
            )
        steps = {m: r["steps"] for m, r in ctx["modes"].items()}
        assert steps["quantspec"]["draft"]["mb_read"] < steps["quantspec"]["verify"]["mb_read"]
        assert steps["quantspec"]["draft"]["weights"] == "int4"
        assert ctx["modes"]["ar"]["speedup_vs_ar"]["median"] == pytest.approx(1.0)
        kv = {m: r["kv_bytes_per_token"] for m, r in ctx["modes"].items()}
        assert kv["quantspec"]["draft"] < kv["quantspec"]["target"] < kv["ar"]["ar"]
        assert kv["draft-w4"]["draft"] == kv["ar"]["ar"]


def test_step_bytes_follow_the_weight_set(tiny_runtime):
    """What a step must read: every linear's weights in the path's set, lm_head included."""
    model = tiny_runtime.model
    layers = linear_layers(model).values()
    full = sum(t.numel() * t.element_size() for m in layers for t in m.parameters(recurse=False))
    assert path_weight_bytes(model, "full") == full
    int8 = sum(m.int8.weight_int8.numel() + 4 * m.int8.weight_scale.numel() for m in layers)
    assert path_weight_bytes(model, "int8") >= int8  # (+ biases, where there are)
    assert path_weight_bytes(model, "int4") < path_weight_bytes(model, "int8") < full
    assert 1e8 < read_bandwidth(mib=8, repeats=2)  # bytes/s: no machine reads under 100 MB/s
    buf = probe_buffer(8)  # (kept between probes: decode_steps.py probes in every repeat)
    assert 1e8 < read_bandwidth(repeats=1, buf=buf) and buf.numel() == 8 * 2**20 // 4
    # where the runner reads bf16 copies of bf16-valued fp32 weights: 2 bytes a weight there
    model = copy.deepcopy(model)
    head = model.lm_head.weight
    with torch.no_grad():
        head.copy_(head.bfloat16().float())  # (the head alone: the others stay fp32 numbers)
    assert (
        path_weight_bytes(model, "full", WeightLayouts(bf16_rows=True)) == full - 2 * head.numel()
    )
    assert path_weight_bytes(model, "full", WeightLayouts(bf16_rows=False)) == full


def test_a_step_reads_a_local_layers_window_not_the_history():
    """Gemma 3's pattern at 8k: 4 global layers read 8,000 positions, 22 local ones 512."""
    from qspec_core.bench.bandwidth import kv_read_positions

    windows = (512,) * 22 + (None,) * 4
    assert kv_read_positions(8000, windows) == pytest.approx((22 * 512 + 4 * 8000) / 26)
    assert kv_read_positions(300, windows) == 300  # (within the window: all of it)
    assert kv_read_positions(8000, (None, None)) == 8000


def test_speedup_pairs_repeat_i_with_repeat_i():
    from qspec_core.bench.runner import Run

    def run(mode, decode_s):
        return Run(mode, 100, 11, 1.0, 1.0, decode_s, {"decode": decode_s}, None, {}, 0, None,
                   "full")  # fmt: skip

    ar = [run("ar", 1.0), run("ar", 4.0), run("ar", 1.5)]
    fast = [run("target-ar", 0.5), run("target-ar", 2.0), run("target-ar", 3.0)]
    summary = summarize_mode(fast, ar)  # pair-wise ratios 2, 2, 0.5
    assert summary["speedup_vs_ar"] == {"median": 2.0, "min": 0.5, "max": 2.0}
    # the ratio of unpaired medians would say 0.75
    unpaired = statistics.median([20, 5, 10 / 3]) / statistics.median([10, 2.5, 10 / 1.5])
    assert unpaired == pytest.approx(0.75)


def test_cli_bench_refuses_bad_input(tmp_path):
    assert_user_error(run_qspec("bench", "--context", "2x"), "--context")
    assert_user_error(run_qspec("bench", "--modes", "ar,fast"), "unknown fast")
    assert_user_error(
        run_qspec("bench", "--context", "64k", "--modes", "ar"), "8192", "qwen2.5-coder-0.5b"
    )
    assert_user_error(run_qspec("bench", "--plot", tmp_path / "x.txt"), "--plot")
    assert not list(tmp_path.iterdir())


@pytest.mark.real_model
def test_real_model_bench_smoke(tmp_path, default_model_dir):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run_qspec(
        "bench", "--context", "448", "--gen", "8", "--repeats", "1", "--modes",
        "ar,target-ar,quantspec,quantspec-w8verify", "--json", out, "--plot", plot,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "quantspec-w8verify" in proc.stdout and "where decoding time goes" in proc.stdout
    report = json.loads(out.read_text())
    assert report["machine"]["threads"] >= 1 and report["machine"]["torch"]
    (ctx,) = report["contexts"]
    assert set(ctx["modes"]) == {"ar", "target-ar", "quantspec", "quantspec-w8verify"}
    for r in ctx["modes"].values():
        assert MODE_KEYS <= r.keys() and r["decode_tokens_per_s"]["median"] > 0
    assert plot.stat().st_size > 10_000


@pytest.mark.real_model
def test_peers_script_puts_qspec_modes_beside_transformers(default_model_dir, monkeypatch):
    """benchmarks/peers.py at a tiny size: qspec's modes are rows of the peers' table, on the
    same token ids (greedy qspec `ar` equals transformers fp32; quantspec equals target-ar).
    On the checkpoint's weights (`full`): the default W8A8 target is another model, which on a
    Zen 5 left transformers' greedy path at the 8th token by a 0.41 logit margin, no near-tie."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"
    spec = importlib.util.spec_from_file_location("peers", path)
    peers = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "peers", peers)  # dataclasses look it up
    spec.loader.exec_module(peers)
    result = peers.run_peers(
        [320],
        gen=12,
        repeats=1,
        peers=("hf",),
        hf_dtypes=("fp32",),
        qspec_modes=("ar", "target-ar", "quantspec"),
        log=lambda m: None,
        target_weights="full",
    )
    rows = {r["peer"]: r for r in result["results"]}
    assert set(rows) == {"qspec-ar", "qspec-target-ar", "qspec-quantspec", "hf-fp32"}
    assert len({r["prompt_tokens"] for r in rows.values()}) == 1  # one prompt for all
    assert all(r["new_tokens"] == 12 and r["decode_tokens_per_s"]["median"] for r in rows.values())
    assert rows["qspec-ar"]["agree_with"] == "hf-fp32"
    assert rows["qspec-ar"]["agree_tokens"] >= 10  # fp32 vs fp32: equal but for near-ties
    assert rows["qspec-quantspec"]["tokens"] == rows["qspec-target-ar"]["tokens"]
    assert rows["qspec-quantspec"]["samples"][0]["extra"]["spec"]["rounds"] > 0


def test_peers_load_no_transformers_model_they_do_not_run(monkeypatch, tmp_path):
    """A llama.cpp-only peers run reads no transformers model: it read one per --hf-dtypes
    all the same (bf16 and fp32), and an 8B-shaped run was OOM-killed at 24 GB by the fp32
    copy (32 GB) before llama.cpp started."""
    import sys
    from pathlib import Path

    import transformers

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    monkeypatch.delitem(sys.modules, "peers_torch", raising=False)
    import peers_torch

    read = []
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: read.append(a) or torch.nn.Module(),
    )
    notes = []
    assert (
        peers_torch.load_hf_peers(tmp_path, ("llama.cpp",), ("bf16", "fp32"), 10, "static", notes)
        == []
    )
    assert read == [] and notes == []
    peers_torch.load_hf_peers(tmp_path, ("hf", "llama.cpp"), ("bf16",), 10, "static", notes)
    assert len(read) == 1


@pytest.mark.real_model
def test_decode_steps_script_times_every_step(default_model_dir, tmp_path):
    """benchmarks/decode_steps.py at a tiny size, with a same-run comparison: every step and
    its switched-off twin is timed and written."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_steps.py"
    out = tmp_path / "steps.json"
    cmd = [sys.executable, str(script), "--context", "200", "--repeats", "1"]
    cmd += ["--compare", "w4a8", "--tokens-per-round", "3.5", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    steps = {"ar", "target-ar", "draft", "draft, whole head", "verify"}
    assert set(result["ms"]) == steps | {f"{s} without w4a8" for s in steps}
    assert all(v > 0 for v in result["ms"].values()) and result["estimated_speedup"] > 0
    # the draft step scores its vocabulary slice, as decoding does, and reads that much less
    assert result["draft_head_rows"] < result["vocab_size"]
    assert result["mb_read"]["draft"] < result["mb_read"]["draft, whole head"]


@pytest.mark.real_model
def test_prefill_products_script_compares_each_product_type_with_fp32(default_model_dir, tmp_path):
    """benchmarks/prefill_products.py at a tiny size: the fp32 run is its own reference (KL
    0), another product type moves the last chunk's next-token laws a little but not to zero,
    the one-chunk run is compared on the same positions; bad input is one `error:` line."""
    import subprocess
    import sys
    from pathlib import Path

    from kernels.cpu import build

    ext = build.load()
    other = "int16" if ext and ext.PREFILL_INT16 else "bf16" if ext and ext.PREFILL_BF16 else None
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "prefill_products.py"
    bad = subprocess.run(
        [sys.executable, str(script), "--tokens", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error:"), bad.stderr
    if other is None:
        pytest.skip("no bf16 or int16 products in this build")
    out = tmp_path / "products.json"
    cmd = [sys.executable, str(script), "--tokens", "1100", "--products", f"fp32,{other}"]
    cmd += ["--target-weights", "full", "--fp32-history", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {r["products"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"fp32", other, "fp32 history"}
    assert rows["fp32"]["kl_mean"] == 0 and rows["fp32"]["positions"] == 512  # (1,024 tokens)
    assert 0 < rows[other]["kl_mean"] < 1e-2 and rows[other]["top1_agree"] > 0.9
    assert rows["fp32 history"]["positions"] == 1024 and rows["fp32 history"]["kl_mean"] > 0


@pytest.mark.parametrize(
    "modes, target_weights, full",
    [
        (("ar", "target-ar", "quantspec"), "w8a8", False),  # (an 8B: INT8 and 4-bit only)
        (("ar", "target-ar", "quantspec"), "full", True),
        (("target-ar", "draft-kv4"), "w8a8", True),  # (its draft: the full weights)
        (("quantspec", "target-ar-full"), "w8a8", True),  # (forced to the full weights)
    ],
)
def test_bench_reads_the_full_weights_only_for_modes_that_run_them(modes, target_weights, full):
    from qspec_core.bench.runner import needs_full_weights

    config = BenchConfig(contexts=[256], gen=8, modes=modes, target_weights=target_weights)
    assert needs_full_weights(config) is full
