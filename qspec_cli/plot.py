"""`qspec bench --plot`: decode tokens/s against context per mode, and the stage shares.

matplotlib is an optional extra (`pip install 'qspec[plot]'`); it is checked before the bench
runs, so a missing one costs nothing.
"""

from __future__ import annotations

from pathlib import Path

from qspec_core.errors import QspecError


def check_plotting(path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise QspecError(
            "--plot needs matplotlib: pip install 'qspec[plot]' (or pip install matplotlib)"
        ) from None
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise QspecError(f"--plot: {path.name} should end in .png, .svg or .pdf")
    if not path.parent.exists():
        raise QspecError(f"--plot: folder {path.parent} does not exist")


def plot_bench(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [c["context"] for c in report["contexts"]]
    modes = report["config"]["modes"]
    fig, (rates, shares) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        ys = [c["modes"][mode]["decode_tokens_per_s"]["median"] for c in report["contexts"]]
        rates.plot(contexts, ys, marker="o", label=mode)
    rates.set_xscale("log", base=2)
    rates.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
    rates.set_xlabel("context (tokens)")
    rates.set_ylabel("decode tokens/s (median)")
    rates.set_ylim(bottom=0)
    rates.grid(alpha=0.3)
    rates.legend()
    last = report["contexts"][-1]
    stage_names = sorted({s for r in last["modes"].values() for s in r["stages"]})
    bottom = [0.0] * len(modes)
    for stage in stage_names:
        values = [last["modes"][m]["stages"].get(stage, {}).get("share", 0.0) for m in modes]
        shares.bar(modes, values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    shares.set_ylabel(f"share of decoding time at {last['context']} tokens")
    shares.tick_params(axis="x", labelrotation=30)
    shares.legend(fontsize="small")
    m = report["machine"]
    fig.suptitle(f"{report['model']} · {m['dtype']} · {m['cpu']} ({m['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
