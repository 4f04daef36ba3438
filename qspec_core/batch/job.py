"""One batch's settings, and the summary of one document under them.

`summarize_document` is what every executor runs (this process, a local worker process, a
Ray actor): it reads the document, answers the prompt with a `ChatSession` on an already
loaded runtime and returns the record the driver writes. A document that fails gives a record
with `error` instead (a bad file must not stop the batch); anything else propagates.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qspec_core.batch.records import new_record
from qspec_core.documents import decode_document, display_name, read_document_digest
from qspec_core.engine.sampling import SamplingParams
from qspec_core.engine.session import SUMMARY_REQUEST, ChatSession
from qspec_core.engine.summary import summary_record
from qspec_core.errors import QspecError


@dataclass(frozen=True)
class BatchSettings:
    """Everything that decides a summary's text and figures: two runs with equal settings
    on equal content give the same record (its `settings_key`), whatever the executor.
    (Threads are not in it: the kernels give the same bits on any thread count.)"""

    model: str | None = None  # --model (None: the default model)
    mode: str = "quantspec"
    gamma: int | str = "auto"
    lookup: bool = True
    max_new_tokens: int = 384
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    truncate: bool = False
    group_size: int | None = None
    target_weights: str = "auto"
    dtype: str = "auto"
    prompt: str = SUMMARY_REQUEST

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)

    def session_kwargs(self) -> dict:
        """`ChatSession`'s arguments under these settings (but the runtime and the document):
        what a batch's worker and `qspec summarize` of one document open their session with."""
        return dict(
            params=self.params,
            seed=self.seed,
            max_new_tokens=self.max_new_tokens,
            mode=self.mode,
            truncate=self.truncate,
            gamma=self.gamma,
            group_size=self.group_size,
            lookup=self.lookup,
        )

    def snapshot_name(self, sha256: str, runtime) -> str:
        """The file name of a document's snapshot under `--snapshots`: its content and what
        its KV depends on (model, target weights, dtype, KV group, the cut of --truncate);
        not the prompt, so another prompt reuses it."""
        parts = [
            runtime.name, runtime.target_weights, str(runtime.model.dtype), self.group_size,
            self.truncate and self.max_new_tokens,
        ]  # fmt: skip
        tag = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]
        return f"{sha256[:32]}-{tag}.qspec"


def summarize_document(
    runtime, path: Path, settings: BatchSettings, snapshots=None, data: bytes | None = None
) -> dict:
    """The record of `path` (its bytes `data` when given: a remote worker): `new_record`'s
    fields, then **summary_record, "seconds", "snapshot"; or "error"."""
    record = new_record(path, settings.key())
    start = time.perf_counter()
    try:
        if data is None:
            text, record["sha256"] = read_document_digest(path)
        else:
            text, record["sha256"] = decode_document(data, display_name(path))
        session, snapshot = _session(runtime, text, record["sha256"], settings, snapshots)
        for _ in session.ask(settings.prompt):
            pass
    except QspecError as e:
        return record | {"error": str(e)}
    record |= summary_record(session, runtime.name, runtime.target_weights)
    record["seconds"] = round(time.perf_counter() - start, 3)
    if snapshot is not None:
        record["snapshot"] = snapshot
    return record


def _session(runtime, text: str, sha256: str, settings: BatchSettings, snapshots):
    """(a ChatSession ready for the prompt, the snapshot it used or wrote: None without
    --snapshots). A snapshot that exists is loaded (no prefill); else the document is
    prefilled and saved there first."""
    kwargs = settings.session_kwargs()
    if snapshots is None or settings.mode == "ar":
        return ChatSession(runtime, text, **kwargs), None
    from qspec_core.store.snapshot import load_snapshot, save_snapshot

    path = Path(snapshots) / settings.snapshot_name(sha256, runtime)
    model = runtime.model
    used = {"path": display_name(path), "loaded": False}
    if path.exists():
        try:
            snap = load_snapshot(
                path, runtime.folder, model, runtime.context_limit, settings.group_size,
                runtime.target_weights,
            )  # fmt: skip
            session = ChatSession(runtime, snap.document, **{**kwargs, "truncate": False})
            session.adopt_cache(snap.cache, snap.token_ids)
            return session, used | {"loaded": True}
        except QspecError as e:  # damaged or stale: a cache miss, made again below
            used["replaced"] = str(e)
    session = ChatSession(runtime, text, **kwargs)
    cache, ids = session.prefill_document()
    extra = {"compute_dtype": str(model.dtype), "target_weights": runtime.target_weights}
    # (written whole or not at all; two workers writing the same one write the same bytes)
    save_snapshot(path, cache, ids, session.document, runtime.folder, runtime.name, True, extra)
    return session, used
