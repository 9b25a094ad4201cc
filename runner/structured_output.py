"""Guided decoding with xgrammar, runner side.

Where each part happens (engine-core process):
- compile:  `XgrammarBackend.compile(spec)`, on the GrammarCache's worker
            threads (scheduler.structured_output) before the request reaches
            the scheduler; an invalid schema/regex/grammar raises
            GrammarCompileError there and the request ends with an ERROR output.
- match:    `GrammarMatchers`, one xgrammar GrammarMatcher per running guided
            request, advanced by every token the request accepts: sampled
            tokens, and the outputs of a resumed (preempted) request when it
            comes back.
- mask:     `GrammarMatchers.fill_bitmask` fills the rows' token bitmasks on
            the CPU (while the device runs the forward pass), and the sampler
            applies them to the logits on the device (`apply_token_bitmask`).

Once a grammar is complete only its stop tokens remain allowed (the request's
EOS and stop_token_ids), so a guided request ends with EOS; max_tokens still
cuts it short. xgrammar (which imports torch) is imported on first use, so an
engine that never sees a guided request never pays for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from scheduler.config import EngineConfig, resolve_model
from scheduler.structured_output import GrammarCache, GrammarCompileError
from scheduler.types import NewRequestData, StructuredOutputSpec

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# "[18:29:16] /project/cpp/regex_converter.cc:94: " and "Check failed: (...) is false: "
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


# ---------------------------------------------------------------------------
# Tokenizer vocabulary -> xgrammar TokenizerInfo
# ---------------------------------------------------------------------------


class TokenizerInfoLoader:
    """Builds the xgrammar TokenizerInfo of the served model's tokenizer, from
    `--tokenizer` or the model source: a tokenizer.json directory (read with
    the `tokenizers`-backed transformers class), another HF tokenizer
    directory (AutoTokenizer), or a GGUF file's embedded vocabulary.

    Special tokens other than the stop tokens are given an empty text, which
    xgrammar never allows inside the output: `<|im_start|>` must not appear
    in a JSON string just because its characters would fit there.
    """

    def __init__(self, config: EngineConfig, vocab_size: int, stop_token_ids: list[int]):
        self.config = config
        self.vocab_size = vocab_size  # the model's (logits width), may exceed the tokenizer's
        self.stop_token_ids = stop_token_ids

    def __call__(self) -> "xgr.TokenizerInfo":
        import xgrammar as xgr

        config = self.config
        path = os.path.expanduser(config.tokenizer) if config.tokenizer else resolve_model(
            config.model, config.load_format).path
        if os.path.isfile(path) and path.endswith(".gguf"):
            vocab, special, vocab_type, add_prefix_space = _gguf_vocab(path)
        elif os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")
        ):
            vocab, special, vocab_type, add_prefix_space = _hf_vocab(path)
        else:
            raise GrammarCompileError(
                "structured outputs need the model's tokenizer, and this model has none (pass --tokenizer)"
            )
        encoded = [""] * self.vocab_size
        for token_id, token in enumerate(vocab[: self.vocab_size]):
            encoded[token_id] = "" if token_id in special else token
        stops = [t for t in self.stop_token_ids if 0 <= t < self.vocab_size] or None
        return xgr.TokenizerInfo(
            encoded, vocab_type, vocab_size=self.vocab_size, stop_token_ids=stops, add_prefix_space=add_prefix_space
        )


def _hf_vocab(path: str) -> tuple[list[str], set[int], Any, bool]:
    import xgrammar as xgr

    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        tok = TokenizersBackend.from_pretrained(path)
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(tok)  # detects the vocab type and prefix space
    vocab_dict = tok.get_vocab()
    vocab = [""] * (max(vocab_dict.values()) + 1)
    for token, token_id in vocab_dict.items():
        vocab[token_id] = token
    special = set(tok.all_special_ids)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        special |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return vocab, special, info.vocab_type, info.add_prefix_space


def _gguf_vocab(path: str) -> tuple[list[str], set[int], Any, bool]:
    """tokenizer.ggml.tokens / token_type / model of a GGUF file. Token type
    3 (control) is special; "gpt2" vocabularies are byte-level, "llama" ones
    SentencePiece with byte fallback."""
    import xgrammar as xgr
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def strings(name: str) -> list[Any]:
        field = reader.fields.get(name)
        if field is None:
            return []
        return [field.parts[i] for i in field.data]

    tokens = [bytes(p).decode("utf-8", errors="replace") for p in strings("tokenizer.ggml.tokens")]
    types = [int(p[0]) for p in strings("tokenizer.ggml.token_type")]
    model = reader.fields.get("tokenizer.ggml.model")
    model_name = bytes(model.parts[model.data[0]]).decode() if model is not None else ""
    if not tokens:
        raise GrammarCompileError(f"{os.path.basename(path)} has no embedded vocabulary; pass --tokenizer")
    special = {i for i, t in enumerate(types) if t == 3}
    if model_name == "gpt2":
        return tokens, special, xgr.VocabType.BYTE_LEVEL, False
    if model_name == "llama":
        return tokens, special, xgr.VocabType.BYTE_FALLBACK, True
    return tokens, special, xgr.VocabType.RAW, False


# ---------------------------------------------------------------------------
# Compiling specs
# ---------------------------------------------------------------------------


def choice_to_ebnf(choices: list[str]) -> str:
    """["yes", 'say "hi"'] -> root ::= "yes" | "say \\"hi\\"" """
    def literal(text: str) -> str:
        out = []
        for ch in text:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


class XgrammarBackend:
    """The GrammarBackend of scheduler.structured_output: spec -> xgrammar
    CompiledGrammar. The tokenizer info and compiler are built on the first
    compile (on a worker thread, never at engine start-up).

    JSON is generated compactly (any_whitespace=False): no runaway whitespace,
    and `strict_mode` keeps objects to the properties the schema names.
    """

    def __init__(self, tokenizer_info_loader: Any, *, max_threads: int = 2):
        self._load_tokenizer_info = tokenizer_info_loader
        self._max_threads = max_threads
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compiler(self) -> "xgr.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # our GrammarCache is the cache; xgrammar's would hold a second copy
                self._compiler = xgr.GrammarCompiler(
                    self._load_tokenizer_info(), max_threads=self._max_threads, cache_enabled=False
                )
            return self._compiler

    def compile(self, spec: StructuredOutputSpec) -> Any:
        compiler = self.compiler()
        try:
            if spec.kind == "json":
                schema = _bounded_strings_as_patterns(_parse_schema(spec.value))
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_to_ebnf(json.loads(spec.value)))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.value)
        except GrammarCompileError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}.get(
                spec.kind, spec.kind)
            raise GrammarCompileError(f"invalid {what}: {_clean_xgrammar_error(e)}") from None
        raise GrammarCompileError(f"unknown structured output kind {spec.kind!r}")


def _parse_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise GrammarCompileError(f"invalid JSON schema: not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarCompileError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
    return schema


# keywords whose values are data, not subschemas: never rewritten
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples"))


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """Work around xgrammar 0.2.9 generating raw control characters (invalid
    JSON) in strings bounded by minLength/maxLength: such a plain string gets
    the equivalent pattern, which xgrammar generates JSON-safely.

    {"type": "string", "maxLength": 8} -> {"type": "string", "maxLength": 8, "pattern": "^.{0,8}$"}
    """
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else _bounded_strings_as_patterns(v)) for k, v in schema.items()}
    kind = out.get("type")
    if (
        (kind == "string" or (isinstance(kind, list) and "string" in kind))
        and ("minLength" in out or "maxLength" in out)
        and not any(k in out for k in ("pattern", "format", "enum", "const"))
    ):
        lo, hi = out.get("minLength", 0), out.get("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = f"^.{{{lo},{hi}}}$"
    return out


def _clean_xgrammar_error(exc: BaseException) -> str:
    lines = [_XGR_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    text = " ".join(line for line in lines if line)
    return text[:1000] or type(exc).__name__


def build_grammar_cache(config: EngineConfig, vocab_size: int, stop_token_ids: list[int]) -> GrammarCache:
    backend = XgrammarBackend(TokenizerInfoLoader(config, vocab_size, stop_token_ids),
                              max_threads=min(4, os.cpu_count() or 1))
    return GrammarCache(backend, max_entries=256, max_workers=2)


# ---------------------------------------------------------------------------
# Matchers and bitmasks
# ---------------------------------------------------------------------------


class _Guided:
    __slots__ = ("matcher", "stop_token_ids", "failed")

    def __init__(self, matcher: Any, stop_token_ids: list[int]):
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.failed = False  # a token was not accepted: only stop tokens from now on


class GrammarMatchers:
    """One GrammarMatcher per running guided request, and the step's bitmask.

    bitmask rows are packed int32 words: bit j of word w allows token 32*w + j
    (xgrammar's layout). Per step:

        rows, bitmask = matchers.fill_bitmask(["a", "b", "c"])   # "b" guided only
        # rows=[1] (index in the given list), bitmask [1, ceil(vocab/32)] on the device
        ... sampler masks logits[rows] with it ...
        matchers.accept(["a", "b", "c"], sampled)
    """

    def __init__(self, cache: GrammarCache, vocab_size: int, max_num_seqs: int, device: torch.device):
        self.cache = cache
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = -(-vocab_size // 32)
        pin = device.type == "cuda"
        self.bitmask_cpu = torch.full((max_num_seqs, self.num_words), -1, dtype=torch.int32, pin_memory=pin)
        self.bitmask_gpu = (
            self.bitmask_cpu if device.type == "cpu" else torch.full_like(self.bitmask_cpu, -1, device=device)
        )
        self._requests: dict[str, _Guided] = {}
        self._batch_matcher: Any = None

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def add_request(self, req: NewRequestData) -> None:
        """A new or resumed request: a fresh matcher that has accepted the
        request's outputs so far. Unguided requests are ignored."""
        spec = req.sampling_params.structured_output
        if spec is None:
            return
        import xgrammar as xgr

        compiled = self.cache.get_or_compile(spec)  # compiled before admission: a cache hit
        stops = list(dict.fromkeys(
            ([req.eos_token_id] if req.eos_token_id is not None else []) + list(req.sampling_params.stop_token_ids)
        ))
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        guided = _Guided(matcher, stops or list(matcher.stop_token_ids))
        for token_id in req.output_token_ids:
            self._accept(req.req_id, guided, token_id)
        self._requests[req.req_id] = guided

    def remove_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def fill_bitmask(self, req_ids: list[str]) -> tuple[np.ndarray, torch.Tensor] | None:
        """Bitmasks of the guided requests among `req_ids` (the rows that
        sample this step, in logits order): (their indices in req_ids,
        [num_guided, num_words] int32 on the device); None if none is guided."""
        requests = self._requests
        rows = [i for i, r in enumerate(req_ids) if r in requests]
        if not rows:
            return None
        import xgrammar as xgr

        bitmask = self.bitmask_cpu
        live: list[Any] = []
        live_idx: list[int] = []
        for k, i in enumerate(rows):
            guided = requests[req_ids[i]]
            if guided.failed or guided.matcher.is_terminated():
                self._only_stop_tokens(k, guided.stop_token_ids)
            else:
                live.append(guided.matcher)
                live_idx.append(k)
        if len(live) == 1:
            live[0].fill_next_token_bitmask(bitmask, live_idx[0])
        elif live:
            if self._batch_matcher is None:
                # half the cores, as xgrammar's "auto": with 2 cores, 1 thread fills a
                # batch of 32 in ~3 us per request, 2 threads (contending with torch) in ~14
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
            self._batch_matcher.batch_fill_next_token_bitmask(live, bitmask, live_idx)
        n = len(rows)
        if self.bitmask_gpu is bitmask:
            return np.asarray(rows, dtype=np.int64), bitmask[:n]
        self.bitmask_gpu[:n].copy_(bitmask[:n], non_blocking=True)
        return np.asarray(rows, dtype=np.int64), self.bitmask_gpu[:n]

    def _only_stop_tokens(self, row: int, stop_token_ids: list[int]) -> None:
        words = self.bitmask_cpu[row]
        words.zero_()
        for t in stop_token_ids:
            if 0 <= t < self.vocab_size:
                words[t // 32] |= _bit(t % 32)

    def accept(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Advance the matchers of the guided requests among req_ids by the
        token each sampled."""
        requests = self._requests
        for req_id, token_id in zip(req_ids, token_ids):
            guided = requests.get(req_id)
            if guided is not None:
                self._accept(req_id, guided, token_id)

    @staticmethod
    def _accept(req_id: str, guided: _Guided, token_id: int) -> None:
        if guided.failed or guided.matcher.is_terminated():
            return
        if not guided.matcher.accept_token(token_id):
            guided.failed = True
            logger.warning("request %s: token %d does not fit its grammar; only stop tokens are allowed from now on",
                           req_id, token_id)


def _bit(j: int) -> int:
    """Bit j of an int32 word, as a Python int torch accepts (bit 31 is negative)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


_DISALLOWED_BY_BYTE: dict[torch.device, torch.Tensor] = {}


def _disallowed_by_byte(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: entry [b, j] is True when bit j of byte value b is 0."""
    table = _DISALLOWED_BY_BYTE.get(device)
    if table is None:
        table = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 0).to(device)
        _DISALLOWED_BY_BYTE[device] = table
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[k], t] = -inf wherever bit t of bitmask[k] is 0, in place.

    logits: [num_rows, vocab] float; bitmask: [len(rows), ceil(vocab / 32)]
    int32 on the same device; rows: [len(rows)] int64. Plain torch, so one
    path serves every device: word 0b...0101 -> tokens 0 and 2 allowed. The
    words are read as little-endian bytes (x86, ARM and CUDA all are), each
    byte expanded through a 256-entry table: byte k of word w covers tokens
    32w + 8k .. 32w + 8k + 7.
    """
    vocab = logits.shape[1]
    num_masked = bitmask.shape[0]
    bytes_ = bitmask.contiguous().view(torch.uint8).long()  # [num_masked, 4 * num_words]
    disallowed = _disallowed_by_byte(logits.device)[bytes_].view(num_masked, -1)[:, :vocab]
    logits[rows] = logits[rows].masked_fill_(disallowed, float("-inf"))
