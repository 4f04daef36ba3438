"""The README's figures, generated from benchmark JSON: a table of current figures and a plot.

It reads the `benchmarks/peers.py` runs named in SOURCES (qspec beside llama.cpp on the same
model's GGUF and the same prompt token ids, one machine, one run), writes one table of their
figures between the markers below in README.md and docs/PERF.md, and draws
docs/time-to-summary.png: the time to the prompt plus N new tokens against the document's
length, qspec and llama.cpp, one pair of lines per CPU class and model. Every number comes from
the JSON; SOURCES adds only what the JSON does not record (the machine's name beyond lscpu's
"AMD EPYC", the build qspec ran, the commit).

    python benchmarks/readme_figures.py           # rewrite both tables and the plot
    python benchmarks/readme_figures.py --check   # exit 1 where a table differs from the JSON
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN = "<!-- figures:begin: written by benchmarks/readme_figures.py from the JSON it names -->"
END = "<!-- figures:end -->"
TARGETS = ("README.md", "docs/PERF.md")
PLOT = "docs/time-to-summary.png"
QSPEC_MODES = ("quantspec", "target-ar")  # the default mode where it ran, else the exact target


@dataclass(frozen=True)
class Source:
    """One peers run and what its JSON does not say. `cpu`: the JSON's `machine.cpu` is lscpu's
    model name, "AMD EPYC" on both machines, so the generation comes from the PERF.md entry
    named in `measured_in` (lscpu's CPU family and model there). `qspec_build`: the
    QSPEC_CPU_ISA qspec's kernels were built for (the JSON records llama.cpp's build only).
    `commit`: `git log --diff-filter=A --format=%h -- <path>`, the commit that added the run.
    `model`: the model's name where the JSON's is a local folder's (a converted fixture)."""

    path: str
    cpu: str
    qspec_build: str
    commit: str
    measured_in: str
    model: str | None = None


# The newest runs per CPU class that put llama.cpp beside qspec.
SOURCES = (
    Source(
        "docs/xeon-2026-12-06-peers-1b-native.json",
        cpu="Intel Xeon (AVX-512 VNNI/BF16), 2 cores; llama.cpp without AMX",
        qspec_build="native",
        commit="a09e0eb",
        measured_in="PERF.md, 2026-12-06: the 1B and 8B shapes",
        model="Llama-3.2-1B shape (random weights)",
    ),
    Source(
        "docs/xeon-2026-12-06-peers-1b-avx2.json",
        cpu="Intel Xeon, 2 cores; both built for AVX2 only",
        qspec_build="avx2",
        commit="a09e0eb",
        measured_in="PERF.md, 2026-12-06: the 1B and 8B shapes",
        model="Llama-3.2-1B shape (random weights)",
    ),
    Source(
        "docs/peers-avx2-zen5-int-products.json",
        cpu="AMD EPYC Zen 5, 2 cores; both built for AVX2 only",
        qspec_build="avx2",
        commit="c6639d8",
        measured_in="PERF.md, 2026-12-04: AVX2 and AVX-VNNI at their integer rates",
    ),
    Source(
        "docs/zen4-session13-peers-8k-smollm2.json",
        cpu="AMD EPYC Zen 4, 2 cores",
        qspec_build="native",
        commit="051e6f1",
        measured_in="PERF.md, 2026-12-03: the prefill attention's products, chosen by measurement",
    ),
    Source(
        "docs/zen4-session13-peers-8k-qwen.json",
        cpu="AMD EPYC Zen 4, 2 cores",
        qspec_build="native",
        commit="051e6f1",
        measured_in="PERF.md, 2026-12-03: the prefill attention's products, chosen by measurement",
    ),
    Source(
        "docs/zen4-session13-peers-32k-qwen.json",
        cpu="AMD EPYC Zen 4, 2 cores",
        qspec_build="native",
        commit="d4fc50b",
        measured_in="PERF.md, 2026-12-03: the prefill attention's products, chosen by measurement",
    ),
)


@dataclass(frozen=True)
class Figure:
    """qspec and llama.cpp at one context of one run: medians over the run's repeats."""

    source: Source
    date: str
    cpu_class: str
    model: str
    quant: str
    context: int  # the run's context size: prompt + new tokens, 2k, 8k, 32k
    prompt_tokens: int
    new_tokens: int
    runs: int
    mode: str
    threads: int
    weights: str  # qspec's target weights, from the run's notes
    peer: str  # llama.cpp as it ran: its Python binding's version, KV type, flash attention
    prefill: tuple[float, float]  # tokens/s: qspec, llama.cpp
    decode: tuple[float, float]  # tokens/s after the first
    total: tuple[float, float]  # seconds to the prompt and the new tokens

    @property
    def series(self) -> tuple[str, str, str]:
        return self.cpu_class, self.source.cpu, self.model


def cpu_class(machine: dict) -> str:
    """AVX-512 or AVX2, from llama.cpp's own system line in the JSON (the build it ran)."""
    info = machine.get("llama_cpp_system_info", "")
    if "AVX512 = 1" in info:
        return "AVX-512"
    if "AVX2 = 1" in info:
        return "AVX2"
    raise ValueError(f"llama.cpp's system info names neither AVX-512 nor AVX2: {info!r}")


def total_s(row: dict) -> float:
    """Median seconds to the prompt plus the new tokens (time to first token + decode)."""
    return statistics.median(sample["total_s"] for sample in row["samples"])


def load_rows(source: Source) -> list[dict]:
    run = json.loads((REPO / source.path).read_text())
    found = cpu_class(run["machine"])
    if (found == "AVX2") != (source.qspec_build == "avx2"):
        raise ValueError(f"{source.path}: llama.cpp ran {found}, qspec {source.qspec_build}")
    for row in run["results"]:
        row["_run"] = run
    return run["results"]


def find(pairs: list[tuple[Source, dict]], peer: str, context: int) -> tuple[Source, dict] | None:
    """The (source, row) of `peer` (a peers.py name: "qspec-target-ar", "llama.cpp-q4_1") or of
    a family ("llama.cpp") at `context`."""
    return next(
        ((s, r) for s, r in pairs if peer in (r["peer"], r["family"]) and r["context"] == context),
        None,
    )


def pick_mode(pairs: list[tuple[Source, dict]], contexts: list[int]) -> str:
    """The first of QSPEC_MODES measured at every context of a series."""
    for mode in QSPEC_MODES:
        if all(find(pairs, f"qspec-{mode}", c) for c in contexts):
            return mode
    raise ValueError(f"no qspec mode of {QSPEC_MODES} at every context {contexts}")


def figures(sources: tuple[Source, ...] = SOURCES) -> list[Figure]:
    """Every context of every source, qspec's mode chosen once per series."""
    by_series: dict[tuple, list[tuple[Source, dict]]] = {}
    for source in sources:
        for row in load_rows(source):
            run = row["_run"]
            key = (cpu_class(run["machine"]), source.cpu, run["settings"]["model"])
            by_series.setdefault(key, []).append((source, row))
    out = []
    for (klass, _, name), pairs in by_series.items():
        model = pairs[0][0].model or name
        contexts = sorted({row["context"] for _, row in pairs if row["family"] == "llama.cpp"})
        mode = pick_mode(pairs, contexts)
        for context in contexts:
            source, peer = find(pairs, "llama.cpp", context)
            _, ours = find(pairs, f"qspec-{mode}", context)
            run = peer["_run"]
            out.append(
                Figure(
                    source=source,
                    date=run["date"][:10],
                    cpu_class=klass,
                    model=model,
                    quant=run["settings"]["gguf"].removesuffix(".gguf").rsplit(".", 1)[-1],
                    context=context,
                    prompt_tokens=ours["prompt_tokens"],
                    new_tokens=ours["new_tokens"],
                    runs=ours["runs"],
                    mode=mode,
                    threads=run["machine"]["threads"],
                    weights=target_weights(run),
                    peer=_peer(run, peer),
                    prefill=_pair(ours, peer, "prefill_tokens_per_s"),
                    decode=_pair(ours, peer, "decode_tokens_per_s"),
                    total=(total_s(ours), total_s(peer)),
                )
            )
    return out


def target_weights(run: dict) -> str:
    """qspec's target weights as peers.py noted them ("... target weights w8a8")."""
    for note in run["notes"]:
        if found := re.search(r"target weights (\S+)", note):
            return found.group(1)
    raise ValueError(f"no target weights in the notes of the run of {run['date']}")


def _peer(run: dict, row: dict) -> str:
    flash = "on" if row["flash_attn"] else "off"
    return (
        f"llama-cpp-python {run['machine']['llama_cpp']}, {row['kv']} KV, flash attention {flash}"
    )


def _pair(ours: dict, peer: dict, field: str) -> tuple[float, float]:
    return ours[field]["median"], peer[field]["median"]


def _rate(pair: tuple[float, float], digits: int) -> str:
    return f"{pair[0]:,.{digits}f} / {pair[1]:,.{digits}f} ({pair[0] / pair[1]:.1f}x)"


def table(figs: list[Figure]) -> str:
    """The markdown table of `figs`, with the notes that say how it was measured."""
    lines = [
        "| date, commit | CPU class: machine | model, llama.cpp's GGUF | prompt + new tokens "
        "| qspec mode | prefill tok/s, qspec / llama.cpp | decode tok/s | "
        "prompt + new tokens, s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        total = f"{f.total[0]:,.1f} / {f.total[1]:,.1f} ({f.total[1] / f.total[0]:.1f}x sooner)"
        lines.append(
            f"| {f.date}, {f.source.commit} | {f.cpu_class}: {f.source.cpu} "
            f"| {f.model.removesuffix('-Instruct')}, {f.quant} "
            f"| {f.prompt_tokens:,} + {f.new_tokens} | `{f.mode}` "
            f"| {_rate(f.prefill, 0)} | {_rate(f.decode, 1)} | {total} |"
        )
    runs = " or ".join(str(n) for n in sorted({f.runs for f in figs}))
    threads = " or ".join(str(n) for n in sorted({f.threads for f in figs}))
    weights = " or ".join(w.upper() for w in _unique(f.weights for f in figs))
    peers = ", ".join(_unique(f.peer for f in figs))
    sources = ", ".join(f"`{s.path}`" for s in _unique(f.source for f in figs))
    lines += [
        "",
        f"Medians of {runs} runs, greedy, {threads} threads, the same prompt token ids for both; "
        f"qspec's target weights {weights} over its INT8 KV view; llama.cpp as {peers}. "
        f"Sources: {sources}.",
    ]
    return "\n".join(lines)


def _unique(items):
    return list(dict.fromkeys(items))


def replace_block(text: str, block: str, name: str) -> str:
    """`text` with the part between BEGIN and END replaced by `block`."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{name}: no {BEGIN!r} ... {END!r} block")
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def marked_block(text: str) -> str:
    """What stands between the markers of `text` (the table a file shows now)."""
    return text.partition(BEGIN)[2].partition(END)[0].strip("\n")


def plot(figs: list[Figure], path: Path) -> None:
    """Seconds to the prompt + new tokens against the context, qspec solid, llama.cpp dashed:
    one pair of lines per series measured at two contexts or more."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lines = [s for s in _unique(f.series for f in figs) if sum(f.series == s for f in figs) > 1]
    for color, key in zip(colors, lines, strict=False):
        points = sorted((f for f in figs if f.series == key), key=lambda f: f.context)
        xs = [f.context for f in points]
        new = "/".join(_unique(str(f.new_tokens) for f in points))
        label = f"{key[0]}, {key[1].split(', ')[0]}, {key[2].removesuffix('-Instruct')}"
        for side, style, name in ((0, "-o", f"qspec {points[0].mode}"), (1, "--s", "llama.cpp")):
            ys = [f.total[side] for f in points]
            ax.plot(xs, ys, style, color=color, label=f"{name}: {label} (+{new} tokens)")
            for x, y in zip(xs, ys, strict=True):
                text = f"{y:,.0f} s" if y >= 10 else f"{y:.1f} s"
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(7, -3), fontsize=8)
    ticks = sorted({f.context for f in figs if f.series in lines})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ticks, [f"{t // 1024}k tokens" for t in ticks])
    ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.4)  # room for the last point's label
    ax.minorticks_off()
    ax.set_xlabel("document length (the context: prompt + new tokens)")
    ax.set_ylabel("seconds to the prompt + new tokens (lower is better)")
    ax.set_title("Time to a summary: qspec against llama.cpp on the same GGUF", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})  # no version stamp: same bytes
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    parser.add_argument("--plot", type=Path, default=REPO / PLOT, help="where the PNG goes")
    args = parser.parse_args(argv)
    figs = figures()
    block = table(figs)
    texts = {name: (REPO / name).read_text() for name in TARGETS}
    new = {name: replace_block(text, block, name) for name, text in texts.items()}  # all or none
    stale = [name for name in TARGETS if marked_block(texts[name]) != block]
    if not args.check:
        for name in stale:
            (REPO / name).write_text(new[name])
    if args.check:
        for name in stale:
            print(f"{name}: the figures table differs from the JSON; run {Path(__file__).name}")
        return 1 if stale else 0
    plot(figs, args.plot)
    print(f"wrote {', '.join(stale) or 'no table (unchanged)'} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
