"""Serval's engine heart, pure Python (no torch): request state, the KV block
manager, the scheduler, the engine-core loop and the types that cross a
process boundary."""

from scheduler.block_manager import BlockManager
from scheduler.config import ConfigError, EngineConfig, SchedulerConfig
from scheduler.engine_core import AsyncModelRunnerProtocol, EngineCore, InprocClient, ModelRunnerProtocol
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.types import (
    EMPTY_RUNNER_OUTPUT,
    MAX_LOGPROBS,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    Logprob,
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    SamplingParamsError,
    SchedulerOutput,
    SchedulerStats,
    StructuredOutputSpec,
)

__all__ = [
    "BlockManager",
    "CachedRequestData",
    "ConfigError",
    "EMPTY_RUNNER_OUTPUT",
    "EngineConfig",
    "EngineCore",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineInfo",
    "FinishReason",
    "InprocClient",
    "Logprob",
    "MAX_LOGPROBS",
    "ModelRunnerProtocol",
    "AsyncModelRunnerProtocol",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RunnerOutput",
    "SamplingParams",
    "SamplingParamsError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputSpec",
]
