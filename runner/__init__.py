"""The execution side: persistent input batch, input preparation, attention
backends, KV cache sizing, sampler, and the engine-core builder.

Entry points (import them from their modules; this package imports nothing):
    runner.engine.build_engine_core     EngineConfig -> (EngineCore, EngineInfo)
    runner.model_runner.ModelRunner     execute(SchedulerOutput) -> RunnerOutput
    runner.attention.get_backend_cls    backend name -> RunnerAttentionBackend class
    runner.sampler.Sampler              batched sampling + logprobs
"""
