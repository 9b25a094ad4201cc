"""Build the engine core of one process: model, KV cache, runner, scheduler.

    core, info = build_engine_core(EngineConfig(model="path/to/ckpt"))

Start-up decisions, all made once here:
- device: --device auto -> cuda when available, else cpu;
- dtype: --dtype auto -> float32 on CPU, the checkpoint's dtype elsewhere
  (bfloat16 when it names none), as models.loader.resolve_dtype decides;
- attention backend: --attention-backend, else flashinfer on CUDA (torch
  when flashinfer is not importable), torch elsewhere;
- layer ops: fused Triton kernels on CUDA (runner.cuda_ops), plain torch elsewhere;
- KV cache: num_gpu_blocks_override, else --kv-cache-memory GiB on CPU,
  else what a profile run leaves of the GPU under --gpu-memory-utilization
  (runner.kv_cache.profile_cuda_memory / cuda_num_blocks);
- CUDA graphs for decode steps: on CUDA unless --enforce-eager (and when the
  backend supports them); the KV cache then gets one extra block, owned by no
  request, that the graphs' padding rows write to;
- max_num_batched_tokens: the flag, else a per-device default;
- max_model_len = min(--max-model-len, the model's max_position_embeddings,
  the KV cache's capacity in tokens).
"""

from __future__ import annotations

import logging

import torch

from runner.attention import AttentionSpec, default_backend_name, get_backend_cls
from runner.kv_cache import KVCacheSpec, determine_num_blocks, profile_cuda_memory
from runner.model_runner import ModelRunner, cdiv
from runner.structured_output import GrammarMatchers, build_grammar_cache
from scheduler.config import ConfigError, EngineConfig, SchedulerConfig, resolve_model
from scheduler.engine_core import EngineCore
from scheduler.types import EngineInfo

logger = logging.getLogger(__name__)

# Tokens per step when --max-num-batched-tokens is not given: on a CPU a
# smaller step keeps decode latency bounded while a long prompt prefills.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 1024, "cuda": 8192}

def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    return torch.device(device)


def _pick_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype):
    name = config.attention_backend or default_backend_name(device)
    if name == "flashinfer" and device.type != "cuda":
        raise ConfigError("--attention-backend flashinfer needs --device cuda; use --attention-backend torch")
    try:
        cls = get_backend_cls(name)
    except ValueError as exc:
        if config.attention_backend is not None:  # asked for explicitly: fail
            raise ConfigError(str(exc)) from exc
        logger.warning("%s; falling back to the torch attention backend", exc)
        cls = get_backend_cls("torch")
    try:
        return cls(device, dtype)
    except ConfigError as exc:  # e.g. flashinfer with --dtype float32
        if config.attention_backend is not None:
            raise
        logger.warning("%s; falling back to the torch attention backend", exc)
        return get_backend_cls("torch")(device, dtype)


def build_engine_core(config: EngineConfig) -> tuple[EngineCore, EngineInfo]:
    """Everything the engine-core process serves with. Raises ConfigError
    (naming the flag) for a misconfiguration."""
    from models.loader import load_model, parse_dtype  # heavy imports only in the engine process

    device = resolve_device(config.device)
    source = resolve_model(config.model, config.load_format)
    torch.manual_seed(config.seed)
    # dtype None ("auto") is resolved by the loader: float32 on CPU, the
    # checkpoint's dtype (bfloat16 if none) elsewhere.
    model, model_config = load_model(source, config.load_format, parse_dtype(config.dtype), device)
    model.eval()
    dtype = next(model.parameters()).dtype
    logger.info("loaded %s (%s) on %s as %s", source.name, model_config.architecture, device, dtype)

    backend = _pick_backend(config, device, dtype)
    backend.configure(
        AttentionSpec(
            num_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            scale=model_config.head_dim**-0.5,
            block_size=config.block_size,
        )
    )
    if device.type == "cuda":
        _install_cuda_ops()
    spec = KVCacheSpec(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=config.block_size,
        dtype=dtype,
    )
    max_num_batched_tokens = config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(device.type, 1024)
    use_graphs = device.type == "cuda" and not config.enforce_eager and backend.supports_graphs
    if device.type == "cuda" and not config.enforce_eager and not use_graphs:
        logger.info("CUDA graphs off: the %s attention backend does not support them", backend.name)
    reserved_bytes = None
    if device.type == "cuda" and config.num_gpu_blocks_override is None:
        reserved_bytes = profile_cuda_memory(
            model,
            backend,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=min(config.max_model_len or model_config.max_position_embeddings, max_num_batched_tokens),
            graph_batch_size=config.max_num_seqs if use_graphs else 0,
            device=device,
        )
    num_blocks = determine_num_blocks(config, spec, device, reserved_bytes)
    max_model_len = _max_model_len(config, model_config, num_blocks)

    # With graphs, block id num_blocks exists only for their padding rows.
    kv_caches = spec.allocate(num_blocks + int(use_graphs), device)
    graph_runner = None
    if use_graphs:
        from runner.cuda_graph import CudaGraphRunner

        graph_runner = CudaGraphRunner(
            model,
            backend,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_req=cdiv(max_model_len, config.block_size),
            hidden_size=model_config.hidden_size,
            dtype=dtype,
            device=device,
        )
        graph_runner.capture(kv_caches, padding_block_id=num_blocks)
    # guided decoding: grammars compile on the cache's threads, matchers live in the runner
    grammar_cache = build_grammar_cache(config, model_config.vocab_size, list(model_config.eos_token_ids))
    runner = ModelRunner(
        model,
        kv_caches,
        backend,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        device=device,
        eos_token_ids=model_config.eos_token_ids,
        seed=config.seed,
        grammar_matchers=GrammarMatchers(grammar_cache, model_config.vocab_size, config.max_num_seqs, device),
        graph_runner=graph_runner,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_chunked_prefill=True,
    )
    core = EngineCore(
        scheduler_config, runner, num_blocks, grammar_cache=grammar_cache,
        async_scheduling=config.async_scheduling_on(device.type),
    )
    info = EngineInfo(
        model=config.served_model_name or source.name,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_blocks=num_blocks,
        max_num_seqs=config.max_num_seqs,
        vocab_size=model_config.vocab_size,
    )
    logger.info(
        "engine ready: max_model_len=%d, max_num_batched_tokens=%d, %d KV blocks of %d (%d tokens), backend=%s, %s",
        max_model_len, max_num_batched_tokens, num_blocks, config.block_size, num_blocks * config.block_size,
        backend.name, "CUDA graphs" if use_graphs else "eager",
    )
    return core, info


def _install_cuda_ops() -> None:
    try:
        from runner.cuda_ops import install_cuda_ops
    except ImportError as exc:
        logger.warning("Triton is not importable (%s): the layers keep their plain torch ops", exc)
        return
    install_cuda_ops()


def _max_model_len(config: EngineConfig, model_config, num_blocks: int) -> int:
    model_max = model_config.max_position_embeddings
    kv_tokens = num_blocks * config.block_size
    limits = {"the model's max_position_embeddings": model_max, "the KV cache capacity": kv_tokens}
    # The torch backend attends over the full context; cap at a sliding window
    # so every position stays inside it (exact, no window mask needed).
    if model_config.sliding_window:
        limits["the model's sliding_window"] = model_config.sliding_window
    wanted = config.max_model_len or model_max
    max_model_len = min(wanted, *limits.values())
    if max_model_len < wanted:
        why = min(limits, key=limits.get)
        if config.max_model_len is not None:
            logger.warning("--max-model-len %d lowered to %d by %s", wanted, max_model_len, why)
        else:
            logger.info("max_model_len %d (limited by %s)", max_model_len, why)
    return max_model_len
