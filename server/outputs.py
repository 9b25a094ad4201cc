"""What generation hands back to users: streaming deltas and final outputs.

`RequestDelta` is one engine sequence's progress since the last delta (the
async client streams these). `RequestOutput` / `CompletionOutput` are the
finished results of the offline `LLM`, shaped as vLLM users expect:
`outputs[0].text`, `outputs[i].token_ids`, `outputs[0].logprobs[pos][token_id].logprob`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# logprobs of one position: token id -> its logprob. The sampled token comes
# first, then the top-N by rank (a token in both appears once).
PositionLogprobs = dict[int, "TokenLogprob"]


@dataclass(slots=True)
class TokenLogprob:
    logprob: float
    rank: int  # 1-based rank in the full distribution
    decoded_token: str  # the token's text on its own


@dataclass(slots=True)
class RequestDelta:
    """One sequence's new output since its previous delta.

    finish_reason: None while running, then "stop" (EOS, a stop token id, or
    a stop string), "length" (max_tokens / max_model_len) or "abort".
    stop_reason: the stop string or stop token id that ended it (None for EOS).
    Counters (num_*) are totals so far, not increments.
    """

    req_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per new token when asked
    cumulative_logprob: float | None = None  # sum over all tokens so far, when logprobs asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # per prompt token, None for the first; sent once, with the first delta after prefill
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    first_scheduled_time: float | None = None  # engine time.time() of first scheduling; first delta only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: RequestDelta) -> None:
        """Fold a later delta of the same sequence into this one (a slow
        consumer gets one combined delta instead of a backlog)."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if self.first_scheduled_time is None:
            self.first_scheduled_time = later.first_scheduled_time
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.cumulative_logprob = later.cumulative_logprob
        self.num_prompt_tokens = later.num_prompt_tokens
        self.num_output_tokens = later.num_output_tokens
        self.num_cached_tokens = later.num_cached_tokens


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0

    def add(self, index: int, delta: RequestDelta) -> None:
        """Apply a delta of the `index`-th sequence (n > 1 fans out)."""
        self.outputs[index].add(delta)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.finished = all(o.finished for o in self.outputs)
