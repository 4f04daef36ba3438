"""Time to the first answer token: from a snapshot vs from the raw document, side by side.

Prefills the document once into a snapshot (timed), then alternates: load the snapshot and
ask, or start from the document and ask; measures the time until the first streamed piece
(snapshot loading and verification included, model loading excluded: same for both).

    python benchmarks/snapshot_ttft.py --doc qspec_core/data/gpl-3.0.txt --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from qspec_core.documents import read_document
from qspec_core.engine.session import ChatSession
from qspec_core.registry.runtime import prepare_and_load
from qspec_core.store.snapshot import load_snapshot, save_snapshot

QUESTION = "Who may copy this document?"


def first_token_seconds(session: ChatSession, t0: float) -> float:
    for _ in session.ask(QUESTION):
        return time.perf_counter() - t0
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=Path, default=Path("qspec_core/data/gpl-3.0.txt"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rt = prepare_and_load(None, need_draft=True)
    text = read_document(args.doc)
    kw = {"mode": "quantspec", "max_new_tokens": 8}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.qspec"
        t0 = time.perf_counter()
        session = ChatSession(rt, text, **kw)
        cache, ids = session.prefill_document()
        prefill_s = time.perf_counter() - t0
        save_snapshot(path, cache, ids, session.document, rt.folder, rt.name)
        write_s = time.perf_counter() - t0 - prefill_s
        c = rt.model.config
        bf16 = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * len(ids)
        runs = {"snapshot": [], "document": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            snap = load_snapshot(path, rt.folder, rt.model, rt.context_limit)
            s = ChatSession(rt, snap.document, **kw)
            s.adopt_cache(snap.cache, snap.token_ids)
            runs["snapshot"].append(first_token_seconds(s, t0))
            t0 = time.perf_counter()
            runs["document"].append(first_token_seconds(ChatSession(rt, text, **kw), t0))
        result = {
            "doc": str(args.doc),
            "tokens": len(ids),
            "prefill_s": prefill_s,
            "snapshot_write_s": write_s,
            "snapshot_bytes": path.stat().st_size,
            "bf16_kv_bytes": bf16,
            "ttft_s": {k: statistics.median(v) for k, v in runs.items()},
            "samples": runs,
            "dtype": str(rt.model.dtype),
        }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
