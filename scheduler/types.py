"""The types that cross a boundary: API process <-> engine core (msgspec over
ZMQ), and scheduler <-> runner (in the engine-core process).

Nothing else crosses a boundary: no dicts of tensors, no tuples, no string
keyed bags. Everything here is plain Python (no torch) so the API process can
import it without pulling torch in.
"""

from __future__ import annotations

import enum
import math

import msgspec

# ---------------------------------------------------------------------------
# Sampling parameters (user facing, validated on construction)
# ---------------------------------------------------------------------------

MAX_LOGPROBS = 20  # OpenAI caps top_logprobs at 20


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A constraint on the output, compiled into a grammar by the engine core.

    kind:  "json" (value: a JSON schema, as JSON text), "json_object" (any
           JSON object; value ""), "regex" (value: the regex), "choice"
           (value: a JSON list of the allowed strings), "grammar" (value: EBNF
           as xgrammar reads it, root rule `root`).
    param: the request field it came from ("response_format",
           "guided_regex", "structured_outputs.json", "tools"...), so a
           schema the engine cannot compile becomes a 400 naming that field.
    Frozen and hashable: (kind, value) is the grammar cache key.
    """

    kind: str
    value: str = ""
    param: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise SamplingParamsError(
                self.param or "structured_output",
                f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {self.kind!r}",
            )

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. Field names and meanings follow vLLM/OpenAI.

    Validated in `__post_init__`, so an invalid value never reaches the
    scheduler: `SamplingParams(top_p=0)` raises
    `SamplingParamsError(param="top_p", ...)`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)  # handled by the detokenizer
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    # guided decoding: the output follows this grammar, then ends with EOS.
    # A guided request always ends when its grammar does: ignore_eos and
    # min_tokens are turned off for it (else EOS, the only token a complete
    # grammar allows, could never end it); max_tokens still applies.
    structured_output: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        if self.structured_output is not None:
            self.ignore_eos = False
            self.min_tokens = 0

        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(param, f"{param} {msg}")

        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            f"must be a finite number >= 0, got {self.temperature}",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        check(self.top_k >= 0, "top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be a finite number > 0, got {self.repetition_penalty}",
        )
        check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        if self.logit_bias is not None:
            for tok, bias in self.logit_bias.items():
                check(
                    isinstance(tok, int) and tok >= 0,
                    "logit_bias",
                    f"keys must be non-negative token ids, got {tok!r}",
                )
                check(
                    math.isfinite(bias) and -100.0 <= bias <= 100.0,
                    "logit_bias",
                    f"values must be in [-100, 100], got {bias} for token {tok}",
                )
        if self.seed is not None:
            check(-(2**63) <= self.seed < 2**64, "seed", f"must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None:
            check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "entries must be non-empty strings")
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "entries must be non-negative token ids",
        )
        if self.logprobs is not None:
            check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


# ---------------------------------------------------------------------------
# API process <-> engine core (msgspec over ZMQ, or in-process)
# ---------------------------------------------------------------------------


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or (decided by the detokenizer) a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # client went away, or an abort was asked for
    ERROR = 3  # the request could not run (e.g. its grammar does not compile); see EngineCoreOutput.error

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A new request, token ids only. n > 1 is fanned out by the client into
    n requests before it gets here."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0


class Logprob(msgspec.Struct, array_like=True):
    """One position's logprobs: the chosen token first, then the top-N.

    token_ids=[chosen, top1, top2...], logprobs=[lp(chosen), lp(top1), ...],
    rank = 1-based rank of the chosen token in the full distribution.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request produced in one step."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None = None  # one per new token when asked
    # prompt logprobs, one per prompt token from position 1, sent once when prefill completes
    prompt_logprobs: list[Logprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # engine wall-clock time (time.time()) the request was first scheduled;
    # set on its first output only, for the queue-time metric
    first_scheduled_time: float | None = None
    # with finish_reason ERROR: why, for the user (the request never ran)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True):
    """Gauges are current values; counters are totals since start."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # prompt tokens found in the cache
    num_blocks_total: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


class EngineInfo(msgspec.Struct):
    """Sent once by a started engine core: what it can serve."""

    model: str
    device: str
    dtype: str
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    vocab_size: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


# ---------------------------------------------------------------------------
# Scheduler <-> runner (same process, plain slotted classes, no serialization)
# ---------------------------------------------------------------------------


class NewRequestData(msgspec.Struct):
    """A request the runner has not seen, or sees again after a preemption.

    On resume after preemption `output_token_ids` holds what was generated
    before, so penalties and seeds continue where they were, and
    `num_computed_tokens` is what the prefix cache still covers.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # EngineCoreRequest.eos_token_id: the sampler masks it (unless ignore_eos)
    # while fewer than min_tokens tokens were generated
    eos_token_id: int | None = None


class CachedRequestData(msgspec.Struct):
    """Requests already in the runner's persistent batch, column-wise.

    req_ids=["a", "b"], new_block_ids=[[], [17]], num_computed_tokens=[40, 7]:
    "b" got block 17 appended to its block table this step.
    `num_computed_tokens` is the count *before* this step's tokens.
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct):
    """One step, as a diff against what the runner already holds.

    num_scheduled_tokens maps req_id -> tokens to run this step (1 for a
    decode, a chunk length for prefill). A request samples a token this step
    iff num_computed_tokens + num_scheduled_tokens reaches its full length
    (prompt + outputs so far); a partial prefill chunk samples nothing.
    finished_req_ids: requests to drop from the persistent batch before this
    step (finished, aborted or preempted since the last step).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]


class RunnerOutput(msgspec.Struct):
    """What the runner produced for one SchedulerOutput.

    req_ids[i] got sampled_token_ids[i] (empty for a partial prefill chunk).
    logprobs[i] is set when the request asked for logprobs and sampled a token.
    prompt_logprobs[req_id] accumulates across prefill chunks; it is set in the
    step that completes the prefill of a request that asked for them.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprob | None] | None = None
    prompt_logprobs: dict[str, list[Logprob]] | None = None


EMPTY_RUNNER_OUTPUT = RunnerOutput(req_ids=[], sampled_token_ids=[])


# ---------------------------------------------------------------------------
# API process <-> engine-core process: the ZMQ messages around the types above
# ---------------------------------------------------------------------------


class EngineAddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class EngineAbortRequests(msgspec.Struct, tag="abort", array_like=True):
    req_ids: list[str]


class EngineShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


# what the API process sends on the engine's input socket
EngineInput = EngineAddRequests | EngineAbortRequests | EngineShutdown


class EngineRequestRejected(msgspec.Struct, tag="rejected", array_like=True):
    """The engine core refused a request (EngineCore.add_request raised)."""

    req_id: str
    message: str


class EngineFatalError(msgspec.Struct, tag="fatal", array_like=True):
    """The engine loop crashed; the process exits right after sending this."""

    message: str
    traceback: str


# what the engine sends on its output socket besides EngineCoreOutputs
EngineNotice = EngineRequestRejected | EngineFatalError


class EngineReady(msgspec.Struct, tag="ready"):
    info: EngineInfo


class EngineStartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str
    traceback: str


# sent once on the ready socket by a starting engine-core process
EngineStartup = EngineReady | EngineStartupFailed
