"""Random-weight checkpoints of real model shapes: inputs for measuring time and memory.

Every shape is a real model's (its config.json, layer count, widths, heads and vocabulary);
the weights are noise, N(0, 0.02) with RMSNorm weights 1, so generated text is noise too.
Nothing is downloaded: the tokenizer is SmolLM2-135M-Instruct's, from qspec's model cache.

    python benchmarks/shapes.py --list
    nice -n 19 python benchmarks/shapes.py llama-3.2-1b [qwen2.5-7b ...] [-o DIR]
        [--gguf q8_0,q4_0 | --gguf none] [--force] [--dry-run]

Per shape, in DIR (default benchmarks/models/, which git ignores):
  <shape>-random/            Hugging Face folder: config.json, generation_config.json, bf16
                             model.safetensors (past 4 GB: model-0000i-of-0000n.safetensors
                             shards and model.safetensors.index.json), tokenizer files, README.md
  <shape>-random.Q8_0.gguf   the same weights for llama.cpp, every matrix Q8_0
  <shape>-random.Q4_0.gguf   the same, every matrix Q4_0
                             (the GGUFs for Llama and Qwen2 shapes; the other families'
                             shapes, and their `llama-as-` twins of the same matrices, are
                             for `qspec bench`)

Existing outputs are kept (--force rewrites them); --dry-run prints the planned files and
sizes, headers included, and leaves DIR untouched.

How the weights are made:
- Deterministic: each tensor comes from its own torch.Generator, seeded from a hash of SEED
  and the tensor's name, drawn in row blocks whose size depends only on the tensor's shape;
  a rerun writes the same bytes, and an output written later holds the same weights as one
  written earlier.
- Streamed: one block (at most 2^24 values) at a time, never the whole model: the
  safetensors header is computed from the shapes and written first, the GGUF's metadata and
  tensor table too (gguf.GGUFWriter), then each block's bytes as it is generated. All the
  outputs of a shape are written in one pass, each block generated once; the GGUFs quantize
  its bf16 values (gguf.quants.quantize), so they hold the safetensors' weights.
- Atomic: every output is written under a temporary name and renamed when complete; Ctrl-C
  or SIGTERM removes the temporary files (a kill -9 leaves a hidden `.<name>...tmp` entry).

The configs are the Instruct models' config.json as published (transformers 4's spelling:
rope_theta and rope_scaling, which qspec reads, Llama 3.x's "llama3" scaling included), with
SmolLM2's token ids (bos 1, eos 2, pad 2) and head_dim stated in all of them (Llama 3.2 ships
it; the others derive the same number). The model's vocabulary is the real one: ids from
49152 up are never produced by the tokenizer, and are "[PAD<id>]" filler tokens (type UNUSED)
in the GGUFs.

The GGUFs follow llama.cpp's converter (convert_hf_to_gguf.py) where it matters for what
llama.cpp computes: Llama's q/k rows reordered for ggml's RoPE, Llama 3.x's RoPE scaling as
a `rope_freqs.weight` tensor, 1-D tensors F32. They differ from llama-quantize's files in
one way: every matrix has the named type, the output (or tied embedding) too, where
llama-quantize would make it Q6_K in a Q4_0 file (gguf has no Q6_K quantizer). qspec's own
GGUF importer reads the rope_freqs tensor back as the llama3 rope_parameters.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shapes_files import GGUFOutput, HFFolder, Output, Tokenizer, blocks
from shapes_table import (
    DEFAULT_OUT,
    GB,
    GGUF_TYPES,
    SHAPES,
    Shape,
    Tensor,
    UsageError,
    check_with_qspec,
    tensors,
)

from qspec_core.config import ModelConfig


@dataclass
class Plan:
    shape: Shape
    tensors: list[Tensor]
    config: ModelConfig  # as qspec reads it
    write: list[Output]
    kept: list[Path]


def plan(shape: Shape, out: Path, kinds: list[str], force: bool, tok: Tokenizer) -> Plan:
    planned = tensors(shape)
    config = check_with_qspec(shape, planned)
    stem = out / f"{shape.name}-random"
    outputs: list[Output] = [HFFolder(shape, planned, stem, tok)]
    for kind in kinds if shape.gguf else []:  # (main says that none is written)
        path = stem.with_name(f"{stem.name}.{kind.upper()}.gguf")
        outputs.append(GGUFOutput(shape, planned, path, kind, tok))
    for o in outputs:
        if o.path.exists() and not (o.path.is_dir() == isinstance(o, HFFolder)):
            kind = "file" if isinstance(o, HFFolder) else "folder"
            raise UsageError(f"{o.path} is a {kind}; move it away")
    write = [o for o in outputs if force or not o.path.exists()]
    kept = [o.path for o in outputs if o not in write]
    return Plan(shape, planned, config, write, kept)


def describe(p: Plan) -> str:
    c, q = p.shape.config, p.config
    factor = (q.rope_scaling or {}).get("factor")  # (LongRoPE has per-frequency factors)
    rope = q.rope_type if factor is None else f"{q.rope_type} x{factor:g}"
    return (
        f"{p.shape.name} ({p.shape.mirrors}): {sum(t.numel for t in p.tensors):,} parameters, "
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP "
        f"{c['intermediate_size']}, heads {c['num_attention_heads']}/"
        f"{c['num_key_value_heads']} x {q.head_dim}, vocab {c['vocab_size']}, "
        f"{'tied' if q.tie_word_embeddings else 'untied'}, RoPE {rope} "
        f"(theta {q.rope_theta:g})"
    )


class Progress:
    """A rich bar of the bytes written when stderr is a terminal, else a line per tensor."""

    def __init__(self, total: int, n_tensors: int):
        self.total, self.n, self.done, self.started = total, n_tensors, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bar = Progress(
                TextColumn("{task.description:<40}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def tensor(self, i: int, t: Tensor) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"[{i}/{self.n}] {t.name}")

    def wrote(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, advance=nbytes)

    def tensor_done(self, i: int, t: Tensor) -> None:
        if self.bar is None:
            shape = "x".join(map(str, t.shape))
            print(
                f"  [{i:>3}/{self.n}] {t.name:<46} {shape:>12}  "
                f"{self.done / GB:6.2f}/{self.total / GB:.2f} GB  "
                f"{time.perf_counter() - self.started:5.0f} s",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def generate(p: Plan) -> None:
    """Write every output of `p.write` in one pass over the tensors, then publish them all;
    on any failure (Ctrl-C included) remove what was written."""
    try:
        for o in p.write:
            o.open(o.path.parent)
        free = shutil.disk_usage(p.write[0].path.parent).free
        need = sum(o.size for o in p.write)
        if need > free:
            raise UsageError(
                f"{p.shape.name} needs {need / GB:.1f} GB, {free / GB:.1f} GB are free in "
                f"{p.write[0].path.parent}"
            )
        progress = Progress(sum(o.data_bytes for o in p.write), len(p.tensors))
        try:
            for i, t in enumerate(p.tensors, 1):
                progress.tensor(i, t)
                for o in p.write:
                    o.begin(t)
                for block in blocks(t):
                    for o in p.write:
                        progress.wrote(o.write(block))
                for o in p.write:
                    o.end(t)
                progress.tensor_done(i, t)
        finally:
            progress.close()
        for o in p.write:
            o.publish()
    finally:
        for o in p.write:
            o.discard()


def dry_run(p: Plan) -> None:
    """The planned files and their sizes, headers included: each output opened (its metadata
    written) in a temporary folder, then discarded."""
    with tempfile.TemporaryDirectory(prefix="shapes-dry-run-") as where:
        for o in p.write:
            try:
                o.open(Path(where))
                for name, size in o.parts():
                    path = os.path.join(o.path.parent, name)  # (a folder's keeps its "/")
                    print(f"  write {path}  {size:,} bytes ({size / GB:.2f} GB)")
            finally:
                o.discard()
    for path in p.kept:
        print(f"  keep  {path} (exists; --force rewrites it)")


def list_shapes() -> None:
    w, m = max(map(len, SHAPES)), max(len(s.mirrors) for s in SHAPES.values())
    print(f"{'shape':<{w}} {'mirrors':<{m}} {'parameters':>15} {'bf16':>9} {'Q8_0':>9} {'Q4_0':>9}")
    for shape in SHAPES.values():
        planned = tensors(shape)
        n = sum(t.numel for t in planned)
        sizes = [2 * n] + [sum(t.gguf_bytes(q) for t in planned) for q, _ in GGUF_TYPES.values()]
        gb = " ".join(f"{s / GB:>6.2f} GB" for s in sizes)
        print(f"{shape.name:<{w}} {shape.mirrors:<{m}} {n:>15,} {gb}")
    print("(bytes: the weights alone, 1 GB = 10^9 bytes)")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(
        description="\n\n".join(__doc__.split("\n\n")[:5]),
        epilog=f"shapes: {', '.join(SHAPES)}; how the weights are made: the module docstring",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("shapes", nargs="*", metavar="SHAPE", help="shapes to write (see --list)")
    ap.add_argument("--list", action="store_true", help="list the shapes with their sizes")
    ap.add_argument(
        "-o", "--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)"
    )
    ap.add_argument(
        "--gguf",
        default="q8_0,q4_0",
        help="GGUF types to write, comma-separated, of q8_0,q4_0; 'none': no GGUF "
        "(default: %(default)s)",
    )
    ap.add_argument("--force", action="store_true", help="rewrite outputs that exist")
    ap.add_argument("--dry-run", action="store_true", help="print the planned files and sizes")
    args = ap.parse_args(argv)
    if not args.list and not args.shapes:
        ap.error("name a shape (--list lists them)")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r} (have: {', '.join(SHAPES)})")
    kinds = [k.strip().lower() for k in args.gguf.split(",") if k.strip()]
    if kinds == ["none"]:
        kinds = []
    bad = [k for k in kinds if k not in GGUF_TYPES]
    if bad or len(set(kinds)) != len(kinds):
        ap.error(f"--gguf takes some of {','.join(GGUF_TYPES)} or 'none', not {args.gguf!r}")
    args.gguf = kinds
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is not a folder")
    return args


def _terminated(signum, frame):
    raise KeyboardInterrupt  # (so that the temporary files are removed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_shapes()
        return 0
    signal.signal(signal.SIGTERM, _terminated)
    started = time.perf_counter()
    try:
        tok = Tokenizer.find()
        plans = [plan(SHAPES[s], args.out, args.gguf, args.force, tok) for s in args.shapes]
        for p in plans:
            print(describe(p), flush=True)
            if args.gguf and not p.shape.gguf:
                print(f"  no GGUF: {p.shape.arch}'s llama.cpp layout is not written here")
            if args.dry_run:
                dry_run(p)
                continue
            for path in p.kept:
                print(f"  kept {path} (exists; --force rewrites it)")
            if p.write:
                generate(p)
                for o in p.write:
                    print(f"  wrote {o.path} ({o.size / GB:.2f} GB)", flush=True)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the outputs being written were removed", file=sys.stderr)
        return 130
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (Linux: KiB)
    print(f"done in {time.perf_counter() - started:.0f} s; peak RSS {peak:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
