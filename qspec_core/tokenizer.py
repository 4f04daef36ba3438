"""Tokenizer and chat template of a model folder, without importing transformers.

`tokenizers` does the encoding; the chat template is the folder's Jinja template rendered the
way transformers renders it (trim_blocks, lstrip_blocks, `raise_exception`), which a test
checks against `transformers.AutoTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from qspec_core.errors import QspecError


def _token_content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


class Tokenizer:
    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        if not path.exists():
            raise QspecError(f"{folder} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises bare Exceptions on bad files
            raise QspecError(f"corrupt tokenizer.json in {folder}: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.chat_template = _chat_template(folder, config)
        self._template = None
        self.eos_token_ids = self._stop_ids(folder)

    def _stop_ids(self, folder: Path) -> tuple[int, ...]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(folder / name).get("eos_token_id")
            ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids.append(self._tok.token_to_id(self.eos_token))
        return tuple(dict.fromkeys(ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (template markup) are parsed."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self.chat_template is None:
            # Plain fallback for base models without a template.
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
            return text + ("Assistant:" if add_generation_prompt else "")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise QspecError(f"corrupt {path}: {e}") from None


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _compile_template(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise QspecError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
