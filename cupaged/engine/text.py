"""Text in, text out: a model's tokenizer and chat template, incremental
decoding for streams, and ``Completion``, what ``Engine.generate`` returns.

* ``TextCodec.from_folder(folder)``: ``tokenizer.json`` through the
  ``tokenizers`` package (the ``tokenizers`` extra) and, from
  ``tokenizer_config.json``, the chat template and the special tokens it
  names. ``TextCodec(tokenizer, chat_template=...)`` for a tokenizer built
  elsewhere (a GGUF file's). None where the folder has no tokenizer.
* ``encode(text, chat=False)``: token ids as transformers' tokenizer gives
  them (``add_special_tokens=True``: the tokenizer's post-processor adds a
  BOS where the model wants one); with ``chat=True`` the text is a user
  message (or a list of ``{"role", "content"}`` messages), rendered by the
  chat template with ``add_generation_prompt=True`` and then tokenized
  without special tokens, as ``apply_chat_template(..., tokenize=True)``.
* Chat templates are Jinja2 (the ``jinja2`` package) rendered the way
  transformers renders them: a sandboxed environment with ``trim_blocks``
  and ``lstrip_blocks``, the ``loopcontrols`` extension, ``tojson``,
  ``raise_exception`` and ``strftime_now``, and the tokenizer's special
  tokens (``bos_token``, ``eos_token``, ...) as variables.
* ``Detokenizer``: the text of a growing list of ids, handed out as the
  new part each time; a trailing incomplete UTF-8 sequence (decoded as
  U+FFFD) is held back until the token that completes it comes.
* ``Completion``: a list of the generated token ids (so code that compared
  ``generate``'s result with lists still does) with ``text``,
  ``finish_reason`` ("stop": a stop token ended it, included; "length":
  ``max_new_tokens`` or the model's length), ``prompt_ids`` and
  ``logprobs`` (the chosen tokens' log probabilities, when asked).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, SetupError
from .gguf import gguf_chat_template, gguf_tokenizer, is_gguf, open_gguf

__all__ = ["Completion", "Detokenizer", "TextCodec", "finish_reason"]

#: tokenizer_config.json keys whose tokens the chat template may name.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Completion(list):
    """The generated token ids of one prompt (a ``list`` of ints), with
    ``prompt_index`` (the prompt's place), ``prompt_ids``, ``text`` (their
    text, decoded on first use; None without a tokenizer),
    ``finish_reason`` ("stop" or "length") and ``logprobs`` (per token a
    dict {token id: log-probability}, the drawn token first; None when not
    asked)."""

    def __init__(
        self,
        token_ids: Iterable[int],
        *,
        prompt_index: int = 0,
        prompt_ids: Sequence[int] = (),
        text: str | None = None,
        finish_reason: str = "length",
        logprobs: Sequence[Mapping[int, float]] | None = None,
        codec: TextCodec | None = None,
    ):
        super().__init__(int(t) for t in token_ids)
        self.prompt_index = prompt_index
        self.prompt_ids = list(prompt_ids)
        self._text = text
        self._codec = codec
        self.finish_reason = finish_reason
        self.logprobs = None if logprobs is None else [{int(k): float(v) for k, v in d.items()} for d in logprobs]

    @property
    def text(self) -> str | None:
        if self._text is None and self._codec is not None:
            self._text = self._codec.decode(list(self))
        return self._text

    @property
    def token_ids(self) -> list[int]:
        return list(self)

    def __repr__(self) -> str:
        text = "" if self.text is None else f", text={self.text!r}"
        return f"Completion({list(self)!r}{text}, finish_reason={self.finish_reason!r})"


def finish_reason(tokens: Sequence[int], stop: Iterable[int], max_new: int) -> str:
    """ "stop" when the last token is a stop token, else "length"."""
    return "stop" if tokens and int(tokens[-1]) in set(stop) and len(tokens) <= max_new else "length"


def _content(entry) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping):
        c = entry.get("content")
        return c if isinstance(c, str) else None
    return None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        v = _content(config.get(key))
        if v is not None:
            out[key] = v
    return out


class TextCodec:
    """A model's tokenizer (a ``tokenizers.Tokenizer``) and chat template."""

    def __init__(self, tokenizer, chat_template: str | None = None, special_tokens: Mapping[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._compiled = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextCodec | None:
        """The folder's tokenizer.json and tokenizer_config.json (None: no
        tokenizer.json, or the ``tokenizers`` package is not installed)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            import tokenizers  # the optional `tokenizers` extra
        except ImportError:
            return None
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exceptions for a bad file
            raise CheckpointError(f"{path}: not a readable tokenizer.json: {e}") from None
        config: dict = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{cfg_path}: not readable JSON: {e}") from None
            if not isinstance(config, dict):
                raise CheckpointError(f"{cfg_path}: expected a JSON object, got {type(config).__name__}")
        template = config.get("chat_template")
        jinja = folder / "chat_template.jinja"  # transformers >= 4.43 saves it beside the config
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{cfg_path}: chat_template: expected a string, got {type(template).__name__}")
        return cls(tok, template, _special_tokens(config))

    @classmethod
    def from_gguf(cls, path: str | Path) -> TextCodec:
        """A GGUF file's tokenizer (``gguf.gguf_tokenizer``), chat template and
        special tokens (SetupError without the packages, CheckpointError for a
        tokenizer it cannot build)."""
        tok = gguf_tokenizer(path)
        g = open_gguf(path)
        special = {}
        for key, name in (
            ("bos", "bos_token"),
            ("eos", "eos_token"),
            ("unknown", "unk_token"),
            ("padding", "pad_token"),
        ):
            i = g.value(f"tokenizer.ggml.{key}_token_id")
            t = tok.id_to_token(int(i)) if isinstance(i, int) and not isinstance(i, bool) else None
            if t is not None:
                special[name] = t
        return cls(tok, gguf_chat_template(path), special)

    @classmethod
    def for_model(cls, path: str | Path) -> tuple[TextCodec | None, str]:
        """(the codec of a model folder or GGUF file, "") or (None, why there is none)."""
        if is_gguf(path):
            try:
                return cls.from_gguf(path), ""
            except SetupError as e:
                return None, str(e)
            except CheckpointError as e:
                if "tokenizer" not in str(e):
                    raise
                return None, str(e)
        codec = cls.from_folder(path)
        if codec is not None:
            return codec, ""
        if not (Path(path) / "tokenizer.json").is_file():
            return None, "the model folder has no tokenizer.json"
        return None, "the tokenizers package is not installed (pip install 'cupaged[tokenizers]')"

    # -- text <-> ids ---------------------------------------------------------------
    def encode(self, text: str | Sequence[Mapping[str, str]], *, chat: bool = False) -> list[int]:
        """Token ids of ``text`` (``chat``: a user message or messages through the chat template)."""
        if chat:
            return list(self.tokenizer.encode(self.render_chat(text), add_special_tokens=False).ids)
        if not isinstance(text, str):
            raise ConfigError(f"prompt: expected a string (or chat=True for messages), got {type(text).__name__}")
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens skipped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # -- chat -------------------------------------------------------------------------
    def render_chat(self, messages: str | Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (a string is one user message)."""
        if self.chat_template is None:
            raise ConfigError("chat: expected a model with a chat template (tokenizer_config.json), got none")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        msgs = list(messages)
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ConfigError(f"messages[{i}]: expected a {{'role': ..., 'content': ...}} mapping, got {m!r}")
        return self._template().render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **self.special_tokens
        )

    def _template(self):
        if self._compiled is None:
            try:
                import jinja2
                from jinja2.ext import loopcontrols
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ConfigError(
                    "chat: expected the jinja2 package for chat templates (pip install 'cupaged[engine]'), got none"
                ) from None

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(
                    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
                )

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateError as e:
                raise ConfigError(f"chat_template: expected a Jinja2 template, got one that fails: {e}") from None
        return self._compiled


class Detokenizer:
    """Text of a growing id list, handed out in new pieces (``push``), in
    time linear in the ids: each push decodes only a short window, as
    vLLM's incremental detokenizer does (the window's start gives a word its
    leading space; a decode ending in U+FFFD waits for more ids)."""

    #: Ids before the new ones decoded with them (context for spacing / merges).
    CONTEXT = 5

    def __init__(self, codec: TextCodec, prefix_ids: Sequence[int] = ()):
        self.codec = codec
        self.ids = list(prefix_ids)
        self._read = len(self.ids)  # ids[:_read] are handed out (or the prompt)
        self._prefix = max(self._read - self.CONTEXT, 0)
        self.text = ""  # what has been handed out

    def push(self, new_ids: Iterable[int]) -> str:
        """The text the new ids add ("" while a character is incomplete)."""
        self.ids.extend(int(t) for t in new_ids)
        before = self.codec.decode(self.ids[self._prefix : self._read])
        after = self.codec.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Whatever is still held back (the end of the stream)."""
        before = self.codec.decode(self.ids[self._prefix : self._read])
        after = self.codec.decode(self.ids[self._prefix :])
        new = after[len(before) :] if len(after) > len(before) else ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new
