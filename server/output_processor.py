"""EngineCoreOutputs -> per-request deltas, shared by `LLM` and the async client.

The engine core speaks token ids; this turns each step's outputs into text
deltas (incremental detokenizer, stop strings with hold-back), logprobs with
token texts, and finish reasons. A stop string is found here, not in the
engine, so the request it ends is reported in `reqs_to_abort`: the caller
aborts it in the engine (whose later outputs for it are then ignored).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from scheduler.types import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprob, SamplingParams
from server.detokenizer import IncrementalDetokenizer
from server.outputs import PositionLogprobs, RequestDelta, TokenLogprob
from server.tokenizer import Tokenizer


@dataclass
class ProcessedOutputs:
    deltas: list[RequestDelta] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # ended by a stop string


class RequestState:
    """The API-side state of one engine request (one sequence)."""

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        arrival_time: float,
    ):
        self.req_id = req_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, params, prompt_token_ids) if tokenizer is not None else None
        )
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None


class OutputProcessor:
    """Tracks every unfinished request; feed it each step's outputs.

    tokenizer=None (a dummy-weights model without one): token ids only,
    empty texts, and stop strings are not supported.
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already running")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this model has none")
        self.requests[req_id] = RequestState(
            req_id, prompt_token_ids, params, self.tokenizer, arrival_time or time.time()
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, req_ids: list[str]) -> list[RequestDelta]:
        """Forget requests (client went away); returns a final "abort" delta
        for each one still running. Held-back text is dropped, not released."""
        deltas = []
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                deltas.append(
                    RequestDelta(
                        req_id=req_id,
                        text="",
                        token_ids=[],
                        finish_reason="abort",
                        cumulative_logprob=state.cumulative_logprob,
                        num_prompt_tokens=state.num_prompt_tokens,
                        num_output_tokens=state.num_output_tokens,
                        num_cached_tokens=state.num_cached_tokens,
                    )
                )
        return deltas

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        for out in outputs:
            state = self.requests.get(out.req_id)
            if state is None:  # aborted or stopped here already
                continue
            delta = self._process_one(state, out)
            if delta.finished:
                del self.requests[out.req_id]
                if out.finish_reason is None:  # we ended it: the engine must too
                    result.reqs_to_abort.append(out.req_id)
            result.deltas.append(delta)
        return result

    def _process_one(self, state: RequestState, out: EngineCoreOutput) -> RequestDelta:
        token_ids = out.new_token_ids
        finish_reason = None if out.finish_reason is None else str(out.finish_reason)
        stop_reason: str | int | None = out.stop_reason
        text = ""
        detok = state.detokenizer
        if detok is not None:
            # EOS / stop token id: the engine ended on the last token, whose
            # text is not part of the output
            stop_terminated = out.finish_reason == FinishReason.STOP
            before = detok.num_output_tokens
            text = detok.update(token_ids, stop_terminated)
            if detok.stop_string is not None:
                # the stop string completes at token number detok.num_output_tokens:
                # later tokens of this step are dropped
                token_ids = token_ids[: detok.num_output_tokens - before]
                finish_reason, stop_reason = "stop", detok.stop_string
            elif finish_reason is not None and not stop_terminated:
                text += detok.flush()

        logprobs = None
        if out.new_logprobs is not None and state.params.logprobs is not None:
            logprobs = [self._position_logprobs(lp) for lp in out.new_logprobs[: len(token_ids)]]
            assert state.cumulative_logprob is not None
            state.cumulative_logprob += sum(lp.logprobs[0] for lp in out.new_logprobs[: len(token_ids)])
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._position_logprobs(lp) for lp in out.prompt_logprobs]

        state.num_output_tokens += len(token_ids)
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        return RequestDelta(
            req_id=state.req_id,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=logprobs,
            cumulative_logprob=state.cumulative_logprob,
            num_prompt_tokens=state.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            first_scheduled_time=out.first_scheduled_time,
        )

    def _position_logprobs(self, lp: Logprob) -> PositionLogprobs:
        """Logprob(token_ids=[chosen, top1, top2], logprobs=[...], rank=r)
        -> {chosen: (lp, r), top1: (lp, 1), top2: (lp, 2)} with token texts."""
        text = self.tokenizer.token_text if self.tokenizer is not None else (lambda t: "")
        result: PositionLogprobs = {}
        for i, (token_id, logprob) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if token_id not in result:
                result[token_id] = TokenLogprob(logprob, lp.rank if i == 0 else i, text(token_id))
        return result


def make_engine_request(
    req_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    arrival_time: float | None = None,
) -> EngineCoreRequest:
    """The engine request for one sequence. EOS ids beyond the tokenizer's
    main one (generation_config lists) become stop token ids."""
    eos_token_id = None
    if tokenizer is not None:
        eos_token_id = tokenizer.eos_token_id
        extra = [t for t in tokenizer.eos_token_ids[1:] if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            params = msgspec.structs.replace(params, stop_token_ids=params.stop_token_ids + extra)
    return EngineCoreRequest(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        eos_token_id=eos_token_id,
        arrival_time=arrival_time or time.time(),
    )
