"""Tokenizer and chat template of a model folder, without importing transformers.

`tokenizers` does the encoding; the chat template is the folder's Jinja template rendered the
way transformers renders it (trim_blocks, lstrip_blocks, `raise_exception`), which a test
checks against `transformers.AutoTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from qspec_core.config import ConfigError, token_ids
from qspec_core.errors import QspecError


def _token_content(token, key: str, path: Path) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, {"content": ...} or null."""
    content = token.get("content") if isinstance(token, dict) else token
    if content is not None and not isinstance(content, str):
        raise QspecError(f"corrupt {path}: {key} must be a string, not {token!r}")
    return content


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
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path)
        self.bos_token = _token_content(config.get("bos_token"), "bos_token", config_path)
        self.eos_token = _token_content(config.get("eos_token"), "eos_token", config_path)
        self.chat_template = _chat_template(folder, config)
        # compiled now, so that a broken template fails while loading, not at the first answer
        self._template = _compile_template(self.chat_template) if self.chat_template else None
        self.eos_token_ids = self._stop_ids(folder)

    def _stop_ids(self, folder: Path) -> tuple[int, ...]:
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            try:
                ids += token_ids(_read_json(folder / name).get("eos_token_id"))
            except ConfigError as e:
                raise QspecError(f"corrupt {folder / name}: {e}") from None
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

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """More UTF-8 bytes of text than any one token stands for: the longest token as the
        vocabulary writes it (byte-level BPE writes each byte as a character of 1-2 bytes,
        SentencePiece a space as 3-byte "▁", byte fallback a byte as "<0x41>"), times 4 where
        a normalizer may shrink the text first (NFKC: 4-byte letters to 1-byte ones)."""
        longest = max(len(token.encode()) for token in self._tok.get_vocab(with_added_tokens=True))
        return longest * (4 if self._tok.normalizer is not None else 1)

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), found without tokenizing (a length check of a
        huge document must not cost what its tokenization does)."""
        return -(-len(text.encode(errors="surrogatepass")) // self.max_token_bytes)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._template is None:
            # Plain fallback for base models without a template.
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
            return text + ("Assistant:" if add_generation_prompt else "")
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except (jinja2.TemplateError, TypeError) as e:  # the model's template, not our code
            raise QspecError(f"the model's chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _read_json(path: Path) -> dict:
    """A JSON object file of the model folder ({} when absent); QspecError if it is not one."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise QspecError(f"corrupt {path}: {e}") from None
    if not isinstance(data, dict):
        raise QspecError(f"corrupt {path}: expected a JSON object, not {type(data).__name__}")
    return data


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise QspecError(f"cannot read {jinja}: {e}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        try:
            named = {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError):
            raise QspecError(
                f"corrupt {folder / 'tokenizer_config.json'}: chat_template must be a string "
                "or a list of {name, template} objects"
            ) from None
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise QspecError(
            f"corrupt {folder / 'tokenizer_config.json'}: chat_template must be a string, "
            f"not {type(template).__name__}"
        )
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
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise QspecError(f"the model's chat template has a syntax error: {e}") from None
