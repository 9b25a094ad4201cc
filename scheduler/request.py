"""Per-request state inside the engine core.

A `Request` lives in the scheduler from `add_request` until it finishes or is
aborted. Its only progress measure is `num_computed_tokens`: how many of
`all_token_ids` have their KV in the cache. A request samples a token in a
step iff that step brings `num_computed_tokens` up to `num_tokens`.

    prompt=[5, 6, 7], outputs=[9]  ->  all_token_ids=[5, 6, 7, 9], num_tokens=4
    after the step that decodes 9: num_computed_tokens=4 -> samples token #2

With async scheduling a step is scheduled before the previous one's sampled
token is known: `num_output_placeholders` counts the tokens sampled by
scheduled steps and not yet appended, so the request's length as the runner
sees it is `num_tokens + num_output_placeholders`.
"""

from __future__ import annotations

import enum

from scheduler.types import EngineCoreRequest, FinishReason, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


def reads_tokens_on_host(params: SamplingParams) -> bool:
    """True when sampling this request's next token reads its earlier tokens
    on the host, so no step may be scheduled while one of its tokens is still
    on the device (async scheduling falls back to a synchronous step):
    guided decoding (the grammar matcher must have accepted every token before
    the next bitmask), and the repetition / frequency / presence penalties
    (the sampler counts the batch's token ids on the host). The one place that
    decides it; everything else the sampler reads (token counts for
    min_tokens and seeds, logit_bias) is known ahead."""
    return (
        params.structured_output is not None
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


_NO_LIMIT = 1 << 62
_NO_STOP_TOKENS: frozenset[int] = frozenset()  # shared: most requests have none

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence being generated. Slotted: the scheduler touches a few
    hundred of these per step.

    `all_token_ids` is maintained incrementally (prompt copied once, each
    output appended), so reading it never rebuilds a list.
    `block_hashes[i]` is the chained hash of full block i, filled lazily by
    the block manager and kept across preemptions (it depends on tokens only).
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "output_token_ids",
        "all_token_ids",
        "status",
        "stop_reason",
        "num_computed_tokens",
        "block_ids",
        "block_hashes",
        "num_hashed_blocks",
        "num_cached_tokens",
        "first_scheduled_time",
        "num_preemptions",
        "max_output_tokens",
        "stop_token_ids",
        "num_output_placeholders",
        "reads_tokens_on_host",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        max_model_len: int | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = prompt_token_ids  # never mutated
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        # blocks [0, num_hashed_blocks) of block_ids were handed to the prefix cache
        self.num_hashed_blocks = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.first_scheduled_time: float | None = None
        self.num_preemptions = 0
        # Outputs allowed before LENGTH: max_tokens, capped so that
        # num_tokens never exceeds max_model_len. max_tokens=None: up to max_model_len.
        limit = sampling_params.max_tokens
        if max_model_len is not None:
            room = max(max_model_len - len(prompt_token_ids), 1)
            limit = room if limit is None else min(limit, room)
        self.max_output_tokens: int = limit if limit is not None else _NO_LIMIT
        stop = sampling_params.stop_token_ids
        self.stop_token_ids = frozenset(stop) if stop else _NO_STOP_TOKENS
        # tokens sampled by scheduled steps whose results are not applied yet (0 or 1)
        self.num_output_placeholders = 0
        self.reads_tokens_on_host = reads_tokens_on_host(sampling_params)

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest, max_model_len: int | None = None) -> Request:
        return cls(
            request.req_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            max_model_len=max_model_len,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={len(self.prompt_token_ids)}, "
            f"outputs={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)})"
        )
