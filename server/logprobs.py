"""Engine logprobs as the OpenAI API shows them: a token id's exact text and
bytes (TokenText), one position split into the sampled token and the top-N
(split_position), and -inf / NaN clamped to a number JSON can carry."""

from __future__ import annotations

import math
from typing import Any

# JSON has no -inf; OpenAI-compatible servers report very unlikely tokens as this.
MIN_LOGPROB = -9999.0

def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's reversible byte -> printable-char map used by
    byte-level BPE vocabularies ('Ġ' is the space byte 0x20)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenText:
    """A token id's exact bytes and its text, cached.

    Byte-level BPE ('Ġhello') maps chars back to bytes; SentencePiece ('▁hello',
    '<0xE2>') maps '▁' to a space and byte pieces to their byte; anything else
    is the UTF-8 of the decoded token. A token that is part of a multi-byte
    character has text with U+FFFD, and its bytes say exactly what it is.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder: dict[str, int] | None = None
        if tokenizer is None:
            return
        try:
            pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" hello world"))
            if any(isinstance(p, str) and "Ġ" in p for p in pieces):
                self._byte_decoder = _byte_level_decoder()
        except Exception:
            pass

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        data = self._bytes(token_id)
        entry = (data.decode("utf-8", errors="replace"), list(data))
        self._cache[token_id] = entry
        return entry

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:  # token-id-only model
            return f"token_id:{token_id}".encode()
        try:
            piece = self.tokenizer.convert_ids_to_tokens([token_id])[0]
        except Exception:
            piece = None
        if isinstance(piece, str):
            if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self._byte_decoder is None:
                return piece.replace("▁", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")


def split_position(position: dict[int, Any], top_n: int) -> tuple[int, float, list[tuple[int, float]]]:
    """One position's logprobs -> (sampled id, its logprob, top-N by rank).

    The engine sends the sampled token first, then the top-N, a token in both
    appearing once: {7: rank 3, 2: rank 1, 9: rank 2} with top_n=2 ->
    (7, lp7, [(2, lp2), (9, lp9)]).
    """
    sampled_id, sampled = next(iter(position.items()))
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank)
    top = [(tid, clamp_logprob(lp.logprob)) for tid, lp in ranked if lp.rank <= top_n][:top_n]
    return sampled_id, clamp_logprob(sampled.logprob), top


def clamp_logprob(value: float) -> float:
    if math.isnan(value):
        return MIN_LOGPROB
    return max(value, MIN_LOGPROB)
