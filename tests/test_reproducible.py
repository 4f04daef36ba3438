"""Greedy output is reproducible: on the real model, greedy quantspec equals target-ar token for
token, and target-ar equals itself, whatever the gamma, the draft source, the planner's
choices, the thread count, a busy process beside it, or whether the document was prefilled
now or restored from a snapshot file. (The long version: benchmarks/stress_greedy.py.)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from stress_greedy import ForcedPlanner, Sources, answer, busy_process  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "qspec_core" / "data"
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def w8a8_runtime(default_converted):
    from qspec_core.registry.runtime import load_runtime

    rt = load_runtime(None, dtype="fp32", log=lambda m: None, need_draft=True)
    return dataclasses.replace(rt, target_weights="w8a8")  # (the CPU default: auto)


@pytest.fixture(scope="module")
def document(w8a8_runtime) -> str:
    tok = w8a8_runtime.tokenizer
    # 1,300 tokens: quantized history, a rotation or two while decoding, lookup hits
    return tok.decode(tok.encode((DATA / "mpl-2.0.txt").read_text())[:1300])


def test_greedy_runs_are_identical_under_stress(w8a8_runtime, document, tmp_path):
    sources = Sources(w8a8_runtime, document, NEW_TOKENS, tmp_path)
    reference = answer(sources.from_text(), "target-ar", 4, True)
    assert len(reference) == NEW_TOKENS  # (a long answer: no early stop hides a difference)
    runs = {"text, quantspec": answer(sources.from_text(), "quantspec", 4, True)}
    threads = torch.get_num_threads()
    try:
        for threads_now, hog in ((threads, False), (1, True), (max(threads, 2), True)):
            torch.set_num_threads(threads_now)
            tag = f"{threads_now} threads{' + hog' if hog else ''}"
            with busy_process(hog):
                runs[f"target-ar, {tag}"] = answer(sources.from_snapshot(), "target-ar", 4, True)
                for gamma in (1, 4, 16):
                    for lookup in (True, False):
                        out = answer(sources.from_snapshot(), "quantspec", gamma, lookup)
                        runs[f"gamma {gamma}, lookup {lookup}, {tag}"] = out
                runs[f"auto, {tag}"] = answer(sources.from_snapshot(), "quantspec", "auto", True)
                for seed in range(2):
                    planner = ForcedPlanner(16, seed)
                    out = answer(sources.from_snapshot(), "quantspec", "auto", True, planner)
                    runs[f"forced planner {seed}, {tag}"] = out
    finally:
        torch.set_num_threads(threads)
    differ = [name for name, out in runs.items() if out != reference]
    assert not differ, f"{len(differ)} of {len(runs)} greedy runs differ: {differ}"


def test_sampled_runs_repeat_with_a_seed(w8a8_runtime, document, tmp_path):
    """Sampling with `--seed`: the same tokens on every run, at any thread count."""
    from qspec_core.engine.sampling import SamplingParams

    sources = Sources(w8a8_runtime, document, NEW_TOKENS, tmp_path)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    runs = []
    threads = torch.get_num_threads()
    try:
        for threads_now in (threads, 1):
            torch.set_num_threads(threads_now)
            session = sources.from_snapshot(params=params, seed=11)
            runs.append(answer(session, "quantspec", 4, True))
    finally:
        torch.set_num_threads(threads)
    other_seed = answer(sources.from_snapshot(params=params, seed=12), "quantspec", 4, True)
    assert runs[0] == runs[1]
    assert other_seed != runs[0]  # (the seed is really used)


def test_a_seed_gives_the_same_sampled_text_whatever_the_gamma(tiny_model_dir):
    """Sampling draws each token's randomness from (seed, its position), never from the order
    of the draws: the rounds' shape (gamma, the draft source, what `auto` picks) cannot change
    the text, and quantspec samples target-ar's very tokens."""
    from qspec_core.engine.sampling import SamplingParams
    from qspec_core.engine.session import ChatSession
    from qspec_core.registry.runtime import load_runtime

    runtime = load_runtime(str(tiny_model_dir), dtype="fp32", log=lambda m: None, need_draft=True)
    text = (DATA / "mpl-2.0.txt").read_text()[:1500]
    params = SamplingParams(temperature=0.9, top_p=0.95)

    def run(mode, gamma, lookup=True, seed=5, planner=None):
        session = ChatSession(runtime, text, params=params, seed=seed, max_new_tokens=24)
        return answer(session, mode, gamma, lookup, planner)

    reference = run("target-ar", 1)
    assert len(reference) == 24
    runs = {f"gamma {g}": run("quantspec", g) for g in (1, 2, 4)}
    runs["gamma 4, no lookup"] = run("quantspec", 4, lookup=False)
    runs["auto"] = run("quantspec", "auto")
    for seed in range(2):  # rounds of random sources and lengths
        runs[f"forced planner {seed}"] = run("quantspec", "auto", planner=ForcedPlanner(8, seed))
    differ = [name for name, out in runs.items() if out != reference]
    assert not differ, f"these sampled runs differ from target-ar's: {differ}"
    assert run("target-ar", 1, seed=6) != reference  # (the seed is really used)
