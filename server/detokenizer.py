"""Incremental detokenization with stop strings, one object per sequence.

Text comes out a piece at a time without ever splitting a character:

- Offsets. `prefix_offset..read_offset` is a window of tokens already turned
  into text; each step decodes `ids[prefix_offset:]` and emits what lies past
  the text of `ids[prefix_offset:read_offset]`. Decoding a window (not one
  token) keeps sentencepiece's leading-space handling right, and the window
  starts in the prompt so the first output token keeps its space. A window
  whose text ends in U+FFFD is an unfinished UTF-8 sequence (a byte-level
  BPE token holding half a character): nothing is emitted until the next
  token completes it.
  ids=[..., "Ġæ", "Ĺ"] -> "…\ufffd" held;  + "¥" -> "日" emitted.
- Stop strings are searched in the text produced so far, across token
  boundaries, and cut from the output (kept with include_stop_str_in_output).
- Hold-back: the longest tail of the text that is a prefix of some stop
  string is not released until it is decided. stop=["</a>"], text "ok </"
  releases "ok " and holds "</"; the next token either completes the stop
  string (finish, "</" never shown) or breaks it (release "</...").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.types import SamplingParams

if TYPE_CHECKING:
    from server.tokenizer import Tokenizer

# prompt tokens decoded with the first output token, for its leading space
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"
_MAX_PENDING_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas.

    `update(new_token_ids, stop_terminated)` returns the text that may be
    shown now; `stop_string` is set once a stop string ended the sequence
    (the caller then finishes it with finish_reason "stop" and aborts it in
    the engine). `flush()` releases the held-back text when the sequence ends
    for another reason.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

        context = prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:]
        if self.skip_special_tokens:
            context = [t for t in context if t not in tokenizer.all_special_ids]
        self.token_ids: list[int] = list(context)  # context + output ids
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_output_tokens = 0

        self.output_text = ""  # everything decoded so far (cut at a stop string)
        self.num_released = 0  # chars of output_text already returned
        self.stop_string: str | None = None

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str:
        """Add tokens, return the newly releasable text.

        stop_terminated: the engine ended the sequence on its last token (EOS
        or a stop token id); that token's text is not part of the output.
        """
        if self.stop_string is not None:
            return ""
        ids = new_token_ids[:-1] if stop_terminated and new_token_ids else new_token_ids
        for token_id in ids:
            self.num_output_tokens += 1
            self.token_ids.append(token_id)
            self.output_text += self._decode_next()
            if self.stop and self.num_output_tokens > self.min_tokens and self._check_stop():
                break
        if stop_terminated or self.stop_string is not None:
            return self.flush()
        return self._release(self._holdback())

    def flush(self) -> str:
        """Release everything left (the sequence is over), including the
        bytes of a character that will now never be completed."""
        if self.stop_string is None and self.read_offset < len(self.token_ids):
            self.output_text += self._decode_next(final=True)
        return self._release(0)

    @property
    def finished_by_stop_string(self) -> bool:
        return self.stop_string is not None

    # -- internals ---------------------------------------------------------

    def _decode_next(self, final: bool = False) -> str:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], skip)
        full_text = decode(self.token_ids[self.prefix_offset :], skip)
        # a trailing U+FFFD is a character still being spelled out; a UTF-8
        # character spans at most 4 byte tokens, so past that it is a real
        # (invalid-bytes) replacement character and comes out like any text
        pending = len(self.token_ids) - self.read_offset
        incomplete = full_text.endswith(_REPLACEMENT_CHAR) and pending < _MAX_PENDING_TOKENS and not final
        if len(full_text) > len(prefix_text) and not incomplete:
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text) :]
        return ""

    def _check_stop(self) -> bool:
        """Find the earliest stop string that ends in not-yet-released text.

        Released text never holds a whole stop string (it was checked), so the
        search for `s` starts len(s)-1 chars before the release point:
        released "ok </", stop "</a>", new "a>" -> search from len("ok ").
        """
        text = self.output_text
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s, max(0, self.num_released - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.stop_string = s
        # never take back released text (possible only before min_tokens)
        end = i + len(s) if self.include_stop_str else max(i, self.num_released)
        self.output_text = text[:end]
        return True

    def _holdback(self) -> int:
        """How many trailing chars could still start a stop string."""
        if not self.stop or self.include_stop_str:
            return 0
        text = self.output_text
        hold = 0
        for s in self.stop:
            # longest k < len(s) with text ending in s[:k]
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _release(self, hold: int) -> str:
        end = max(self.num_released, len(self.output_text) - hold)
        delta = self.output_text[self.num_released : end]
        self.num_released = end
        return delta
