"""Tokenizer loading, torch-free.

The API process must not import torch, and `transformers.AutoTokenizer`
imports it (through its config classes), as does building a tokenizer from
GGUF metadata. So we load every tokenizer through the `tokenizers`-backed
class only, from a directory holding `tokenizer.json`:

- an HF checkpoint directory with `tokenizer.json`: loaded directly;
- a .gguf file, or an HF directory with only a sentencepiece model: converted
  once by transformers in a subprocess (or in-process if torch is already
  loaded, as in the offline `LLM`), saved as a normal tokenizer directory
  under the cache ($SERVAL_CACHE or ~/.cache/serval)/tokenizers/<key>, and
  loaded from there, torch-free, ever after.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from scheduler.config import ConfigError, ModelSource

logger = logging.getLogger(__name__)

_CONVERT_SCRIPT = """
import sys
from transformers import AutoTokenizer
src, gguf_file, out = sys.argv[1], sys.argv[2] or None, sys.argv[3]
kwargs = {"gguf_file": gguf_file} if gguf_file else {}
AutoTokenizer.from_pretrained(src, **kwargs).save_pretrained(out)
"""


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed."""


def cache_dir() -> str:
    root = os.environ.get("SERVAL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "serval")
    return os.path.join(root, "tokenizers")


class Tokenizer:
    """A Hugging Face fast tokenizer plus what the server needs from it.

    `hf` is the transformers tokenizer (chat templates), `backend` the Rust
    `tokenizers.Tokenizer` used for encode/decode on the hot path.
    """

    def __init__(self, hf: Any, name_or_path: str, extra_eos_token_ids: list[int] | None = None):
        self.hf = hf
        self.backend = hf.backend_tokenizer
        self.name_or_path = name_or_path
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        eos += [t for t in (extra_eos_token_ids or []) if t not in eos]
        # every token that ends generation (EOS plus generation_config extras)
        self.eos_token_ids: list[int] = eos
        self.all_special_ids: set[int] = set(hf.all_special_ids)
        self.vocab_size: int = len(hf)  # includes added tokens
        # a few models ship named templates: {"default": ..., "tool_use": ...}
        templates = hf.chat_template if isinstance(hf.chat_template, dict) else {"default": hf.chat_template}
        self.chat_template: str | None = templates.get("default")
        self.tool_chat_template: str | None = templates.get("tool_use")
        self._token_text_cache: dict[int, str] = {}

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(t) or "" for t in token_ids]

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own, as shown in logprobs (cached)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render a conversation. tokenize=True: prompt token ids (the template
        writes its own special tokens, so none are added); False: the text."""
        template = load_chat_template(chat_template)
        if template is None:
            template = (tools and self.tool_chat_template) or self.chat_template
        if template is None:
            raise ChatTemplateError(
                f"the tokenizer of {self.name_or_path} has no chat template; pass --chat-template FILE"
            )
        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                chat_template=template,
                **template_kwargs,
            )
        except Exception as e:  # jinja errors, raise_exception() in templates
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False)


def load_chat_template(template: str | None) -> str | None:
    """`--chat-template` is a file path or the template text itself."""
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if "{" not in template and (template.endswith((".jinja", ".j2", ".txt")) or os.sep in template):
        raise ConfigError(f"--chat-template {template}: no such file")
    return template


def _cache_key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _convert(src_dir: str, gguf_file: str | None, key: str) -> str:
    """Save the transformers tokenizer of `src_dir` (+ `gguf_file`) as a
    tokenizer directory under the cache; returns that directory."""
    out = os.path.join(cache_dir(), key)
    if os.path.isfile(os.path.join(out, "tokenizer.json")):
        return out
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=cache_dir())
    try:
        if "torch" in sys.modules:  # already paid for: convert here
            from transformers import AutoTokenizer

            kwargs = {"gguf_file": gguf_file} if gguf_file else {}
            AutoTokenizer.from_pretrained(src_dir, **kwargs).save_pretrained(tmp)
        else:
            logger.info("converting the tokenizer of %s once (cached in %s)", gguf_file or src_dir, out)
            proc = subprocess.run(
                [sys.executable, "-c", _CONVERT_SCRIPT, src_dir, gguf_file or "", tmp],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                raise ConfigError(
                    f"could not build a tokenizer from {os.path.join(src_dir, gguf_file or '')}:\n"
                    f"{proc.stderr[-3000:]}"
                )
        if not os.path.isfile(os.path.join(tmp, "tokenizer.json")):
            raise ConfigError(f"{src_dir}: transformers could not build a fast tokenizer (no tokenizer.json)")
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race
            if not os.path.isfile(os.path.join(out, "tokenizer.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _generation_eos_ids(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [t for t in eos if isinstance(t, int)]
    return []


def _has_tokenizer_files(path: str) -> bool:
    return any(
        os.path.isfile(os.path.join(path, f))
        for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    )


def load_tokenizer(
    source: ModelSource, tokenizer_path: str | None = None, chat_template: str | None = None
) -> Tokenizer:
    """The tokenizer of a model (or of `--tokenizer PATH`), torch-free.

    `chat_template` (text or a file path) replaces the model's own template.
    Raises ConfigError when there is no tokenizer to load.
    """
    from transformers.tokenization_utils_tokenizers import TokenizersBackend  # no torch

    path = os.path.expanduser(tokenizer_path) if tokenizer_path else source.path
    extra_eos: list[int] = []
    if os.path.isfile(path) and path.endswith(".gguf"):
        st = os.stat(path)
        key = _cache_key("gguf", os.path.realpath(path), str(st.st_size), str(st.st_mtime_ns))
        tok_dir = _convert(os.path.dirname(os.path.abspath(path)), os.path.basename(path), key)
    elif os.path.isdir(path):
        if not _has_tokenizer_files(path):
            raise ConfigError(
                f"{path} has no tokenizer files (tokenizer.json, tokenizer.model...); pass --tokenizer PATH"
            )
        extra_eos = _generation_eos_ids(path)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok_dir = path
        else:  # sentencepiece / vocab+merges only: let transformers convert once
            st = os.stat(path)
            key = _cache_key("dir", os.path.realpath(path), str(st.st_mtime_ns))
            tok_dir = _convert(path, None, key)
    else:
        raise ConfigError(f"--tokenizer {path}: not a directory or a .gguf file")

    hf = TokenizersBackend.from_pretrained(tok_dir)
    tok = Tokenizer(hf, source.name if tokenizer_path is None else path, extra_eos)
    if chat_template is not None:
        tok.chat_template = load_chat_template(chat_template)
    return tok
