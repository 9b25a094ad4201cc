"""Offline throughput and decode latency of the engine, in process, on token ids.

    python -m bench.offline --model llama-3.1-8b --load-format dummy \\
        --num-prompts 1 --input-len 128 --output-len 256 --baseline-hf
    serval bench offline --model qwen3-0.6b --load-format dummy \\
        --num-prompts 256 --input-len 100:1024 --output-len 100:1024

Every request is random token ids (seeded), `ignore_eos`, greedy; lengths
are fixed (`--input-len 128`) or uniform in a range (`100:1024`). All
requests are added at once, then `EngineCore.step()` runs until they finish
(no HTTP, no tokenizer). A warm-up request runs first, untimed.
Async scheduling is on by default on CUDA (as in `serval serve`);
`--async-scheduling` / `--no-async-scheduling` force it (the result name
then gets `_async` / `_sync`), so one device call can run both modes.

Reported (and written to bench/results/<name>.json):
- output tokens/s and total (prompt + output) tokens/s over the whole run;
- the mean engine step time of decode-only steps, and its runner share;
- the roofline floor of the same steps on this host: per step
  max((weight bytes + KV bytes read) / HBM bandwidth, 2 * params * tokens / matmul rate),
  with the H200's measured 4.19e12 B/s and 790e12 FLOP/s (bench/results/GPU_NOTES.md),
  and achieved / floor;
- the GPU's idle fraction over a window of steady decode steps (torch.profiler
  kernel and copy intervals: 1 - busy / span);
- with --baseline-hf: transformers `generate` on the same config with random
  weights, in the same process after the engine is freed (the result file is
  written before it starts, and again with it). Leave it room with
  --gpu-memory-utilization (e.g. 0.7 for an 8B model).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

HBM_BYTES_PER_S = 4.19e12  # H200, read-only bandwidth measured on the host (GPU_HOST.md)
MATMUL_FLOP_PER_S = 790e12  # H200, bf16 8192^3 matmul measured on the host

logger = logging.getLogger("serval.bench")


def parse_len(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "100:1024" -> (100, 1024), inclusive."""
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"want N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo_i, hi_i


def build_parser(prog: str = "serval bench offline") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="shipped config name (llama-3.1-8b, qwen3-0.6b, ...) or a path")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=1)
    p.add_argument("--input-len", type=parse_len, default=(128, 128), help="N, or LO:HI (uniform)")
    p.add_argument("--output-len", type=parse_len, default=(256, 256), help="N, or LO:HI (uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None, help="default: longest input + longest output")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (EngineConfig.async_scheduling; default: on for CUDA)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--profile-steps", type=int, default=20,
                   help="decode steps traced with torch.profiler for the GPU idle fraction (0: off)")
    p.add_argument("--baseline-hf", action="store_true", help="also time transformers generate")
    p.add_argument("--baseline-batch", type=int, default=None, help="HF batch (default: min(num_prompts, 64))")
    p.add_argument("--baseline-new-tokens", type=int, default=64, help="HF new tokens per request")
    p.add_argument("--name", default=None, help="result file name (default from model and workload)")
    p.add_argument("--results-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--log-level", default="info")
    return p


# ---------------------------------------------------------------------------
# Step records
# ---------------------------------------------------------------------------


@dataclass
class StepRecord:
    num_reqs: int
    num_tokens: int
    kv_tokens: int  # sum of seq_len over the step's requests (context read + this step)
    decode_only: bool
    runner_s: float
    engine_s: float = 0.0
    profiled: bool = False
    # host time inside the runner: input preparation, the forward's launch
    # (graph replay or eager), and the wait for the step's device work
    prepare_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0


class TimedRunner:
    """Wraps the engine's runner: times `execute` (and, by wrapping three of
    the ModelRunner's methods on the instance, where its host time goes) and
    records the step's shape. With async scheduling, `execute_async` is timed
    as runner_s (the launch) and the step's `result()` as its wait_s."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.steps: list[StepRecord] = []
        self._split: dict[str, float] = {}
        for method, key in (("_prepare_inputs", "prepare_s"), ("_forward", "launch_s"), ("_wait_sampled", "wait_s")):
            if hasattr(runner, method):
                setattr(runner, method, self._timed(getattr(runner, method), key))

    def _timed(self, fn, key: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._split[key] = self._split.get(key, 0.0) + time.perf_counter() - start

        return wrapper

    def execute(self, so):
        self._split.clear()
        start = time.perf_counter()
        out = self.runner.execute(so)
        self._record(so, time.perf_counter() - start)
        return out

    def execute_async(self, so):
        self._split.clear()
        start = time.perf_counter()
        handle = self.runner.execute_async(so)
        return _TimedStep(handle, self._record(so, time.perf_counter() - start))

    def _record(self, so, elapsed: float) -> StepRecord:
        computed = sum(so.scheduled_cached_reqs.num_computed_tokens) + sum(
            r.num_computed_tokens for r in so.scheduled_new_reqs
        )
        self.steps.append(
            StepRecord(
                num_reqs=len(so.num_scheduled_tokens),
                num_tokens=so.total_num_scheduled_tokens,
                kv_tokens=computed + so.total_num_scheduled_tokens,
                decode_only=all(n == 1 for n in so.num_scheduled_tokens.values()),
                runner_s=elapsed,
                **self._split,
            )
        )
        return self.steps[-1]


class _TimedStep:
    def __init__(self, handle: Any, record: StepRecord) -> None:
        self.handle = handle
        self.record = record

    def result(self):
        start = time.perf_counter()
        out = self.handle.result()
        self.record.wait_s = time.perf_counter() - start
        return out


# ---------------------------------------------------------------------------
# GPU idle fraction from a profiler trace
# ---------------------------------------------------------------------------


TOP_KERNELS = 16  # kernels listed by their time per step
SMALL_GAP_S = 20e-6  # idle gaps shorter than this are kernel-to-kernel, longer ones wait for the host


def gpu_trace_summary(prof, num_steps: int) -> dict:
    """From the traced GPU kernels and copies (their union over first start ..
    last end): the idle fraction, split into short gaps between kernels and
    long ones (the host), kernels per step, and the kernels that take most time."""
    events = []  # (start, end, name), seconds
    try:
        for e in prof.profiler.kineto_results.events():
            if e.device_type().name == "CUDA" and e.duration_ns() > 0:
                events.append((e.start_ns() * 1e-9, (e.start_ns() + e.duration_ns()) * 1e-9, e.name()))
    except Exception:  # other profiler internals: the public events
        import torch

        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                events.append((e.time_range.start * 1e-6, e.time_range.end * 1e-6, e.name))
    if not events:
        raise RuntimeError("the profiler recorded no GPU activity")
    events.sort()
    busy = small_gaps = large_gaps = 0.0
    cur_start, cur_end = events[0][0], events[0][1]
    by_name: dict[str, float] = {}
    for start, end, name in events:
        by_name[name] = by_name.get(name, 0.0) + end - start
        if start > cur_end:
            busy += cur_end - cur_start
            gap = start - cur_end
            if gap < SMALL_GAP_S:
                small_gaps += gap
            else:
                large_gaps += gap
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - events[0][0]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {
        "gpu_idle_fraction": 1.0 - busy / span,
        "gpu_idle_between_kernels_fraction": small_gaps / span,  # gaps < 20 us
        "gpu_idle_waiting_host_fraction": large_gaps / span,  # gaps >= 20 us
        "window_gpu_span_ms": span * 1e3,
        "gpu_kernels_per_step": len(events) / num_steps,
        "gpu_busy_ms_per_step": busy * 1e3 / num_steps,
        "gpu_top_kernels_ms_per_step": {name[:80]: t * 1e3 / num_steps for name, t in top},
    }


# ---------------------------------------------------------------------------
# The engine run
# ---------------------------------------------------------------------------


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_prompts):
        n_in = rng.randint(*args.input_len)
        n_out = rng.randint(*args.output_len)
        work.append(([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return work


def run_engine(args, config) -> dict:
    import torch

    from runner.engine import build_engine_core
    from scheduler.engine_core import freeze_gc_after_startup
    from scheduler.types import EngineCoreRequest, SamplingParams

    t0 = time.perf_counter()
    core, info = build_engine_core(config)
    freeze_gc_after_startup()  # as the engine-core process does
    startup_s = time.perf_counter() - t0
    runner = core.runner
    model = runner.model
    timer = TimedRunner(runner)
    core.runner = timer

    def add(req_id: str, prompt: list[int], n_out: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        core.add_request(EngineCoreRequest(req_id=req_id, prompt_token_ids=prompt, sampling_params=params))

    # warm-up, untimed: a prefill and a few decode steps
    rng = random.Random(args.seed + 1)
    for i in range(2):
        add(f"warmup-{i}", [rng.randrange(info.vocab_size) for _ in range(16 + 8 * i)], 8)
    while core.has_unfinished_requests():
        core.step()
    timer.steps.clear()

    work = make_workload(args, info.vocab_size)
    expected_out = sum(n for _, n in work)
    num_prompt_tokens = sum(len(p) for p, _ in work)
    gc.collect()
    gc.freeze()  # the workload's lists are long-lived: keep the collector off them

    prof = None
    prof_start = 0
    prof_tries = 0
    idle = None
    produced = 0
    start = time.perf_counter()
    for i, (prompt, n_out) in enumerate(work):
        add(f"req-{i}", prompt, n_out)
    while core.has_unfinished_requests():
        if (
            prof is None and idle is None and args.profile_steps > 0 and prof_tries < 3 and torch.cuda.is_available()
            and produced >= 0.3 * expected_out and timer.steps and timer.steps[-1].decode_only
        ):
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_start = len(timer.steps)
            prof_tries += 1
        step_start = time.perf_counter()
        n_before = len(timer.steps)
        outputs = core.step()
        step_s = time.perf_counter() - step_start
        if len(timer.steps) > n_before:
            rec = timer.steps[-1]
            rec.engine_s = step_s
            rec.profiled = prof is not None
        produced += sum(len(o.new_token_ids) for o in outputs.outputs)
        if prof is not None and (len(timer.steps) - prof_start >= args.profile_steps or not core.has_unfinished_requests()):
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            window = timer.steps[prof_start:]
            if window and all(r.decode_only for r in window):
                try:
                    idle = gpu_trace_summary(prof, len(window))
                    idle["window_steps"] = len(window)
                    idle["window_mean_batch"] = statistics.mean(r.num_reqs for r in window)
                except Exception as exc:  # keep the run's figures
                    logger.warning("GPU idle fraction: %s", exc)
                    idle = {"gpu_idle_fraction_error": f"{type(exc).__name__}: {exc}"}
            prof = None
    elapsed = time.perf_counter() - start
    gc.unfreeze()

    stats = core.make_stats()
    steps = timer.steps
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    mc = model.config
    kv_bytes_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * next(model.parameters()).element_size()

    def floor_s(r: StepRecord) -> float:
        return max((weight_bytes + r.kv_tokens * kv_bytes_per_token) / HBM_BYTES_PER_S,
                   2 * num_params * r.num_tokens / MATMUL_FLOP_PER_S)

    decode = [r for r in steps if r.decode_only and not r.profiled]
    total_floor = sum(floor_s(r) for r in steps)
    output_tokens = produced
    metrics: dict[str, Any] = {
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (output_tokens + num_prompt_tokens) / elapsed,
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "prompt_tokens": num_prompt_tokens,
        "num_steps": len(steps),
        "num_decode_steps": sum(r.decode_only for r in steps),
        "startup_s": startup_s,
        "kv_cache_tokens": info.num_blocks * info.block_size,
        "max_model_len": info.max_model_len,
        "num_preemptions": stats.num_preemptions_total,
    }
    floor: dict[str, Any] = {
        "elapsed_s": total_floor,
        "output_tok_s": output_tokens / total_floor,
        "achieved_over_floor": total_floor / elapsed,  # fraction of the floor's speed reached
        "model": "per step max((weights + KV read) / 4.19e12 B/s, 2 * params * tokens / 790e12 FLOP/s)",
        "weight_bytes": weight_bytes,
        "num_params": num_params,
        "kv_bytes_per_token": kv_bytes_per_token,
    }
    if decode:
        step_ms = [r.engine_s * 1e3 for r in decode]
        metrics.update({
            "ms_per_decode_step": statistics.mean(step_ms),
            "ms_per_decode_step_median": statistics.median(step_ms),
            "ms_runner_per_decode_step": statistics.mean(r.runner_s * 1e3 for r in decode),
            # where a decode step's host time goes (the rest of the runner: sampling launches, bookkeeping)
            "ms_host_prepare_inputs": statistics.mean(r.prepare_s * 1e3 for r in decode),
            "ms_host_forward_launch": statistics.mean(r.launch_s * 1e3 for r in decode),
            "ms_wait_for_gpu": statistics.mean(r.wait_s * 1e3 for r in decode),
            "ms_engine_outside_runner": statistics.mean((r.engine_s - r.runner_s) * 1e3 for r in decode),
            "mean_decode_batch": statistics.mean(r.num_reqs for r in decode),
        })
        decode_floor_ms = statistics.mean(floor_s(r) * 1e3 for r in decode)
        floor["ms_per_decode_step"] = decode_floor_ms
        floor["decode_achieved_over_floor"] = decode_floor_ms / metrics["ms_per_decode_step"]
    if idle is not None:
        metrics.update(idle)
    return {"metrics": metrics, "floor": floor, "info": {"dtype": info.dtype, "device": info.device}}


# ---------------------------------------------------------------------------
# transformers baseline
# ---------------------------------------------------------------------------


def run_hf_baseline(args, config_dir: str, vocab_size: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    batch = args.baseline_batch or min(args.num_prompts, 64)
    input_len = args.input_len[0]
    new_tokens = args.baseline_new_tokens
    hf_config = AutoConfig.from_pretrained(config_dir)
    dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine run
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(vocab_size, (batch, input_len), generator=gen).cuda()
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        assert out.shape[1] == input_len + n
        return time.perf_counter() - start

    timed(2)  # warm-up
    t_one = timed(1)
    t_all = timed(new_tokens)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "name": "transformers generate (eager, random weights, same config)",
        "workload": {"batch": batch, "input_len": input_len, "new_tokens": new_tokens},
        "output_tok_s": batch * new_tokens / t_all,
        "ms_per_decode_step": (t_all - t_one) / (new_tokens - 1) * 1e3,
    }


# ---------------------------------------------------------------------------


def bench_main(argv: list[str] | None = None, prog: str = "serval bench offline") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "offline":
        argv = argv[1:]
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from scheduler.config import EngineConfig, resolve_model

    source = resolve_model(args.model, args.load_format)
    max_model_len = args.max_model_len or (args.input_len[1] + args.output_len[1])
    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
    )
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(source.path).vocab_size if source.kind != "gguf" else None

    if args.baseline_hf and (source.kind == "gguf" or not torch.cuda.is_available()):
        raise SystemExit("--baseline-hf needs CUDA and a config directory")
    result = run_engine(args, config)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    in_lo, in_hi = args.input_len
    out_lo, out_hi = args.output_len
    workload = {
        "num_prompts": args.num_prompts,
        "input_len": in_lo if in_lo == in_hi else [in_lo, in_hi],
        "output_len": out_lo if out_lo == out_hi else [out_lo, out_hi],
        "distribution": "fixed" if (in_lo == in_hi and out_lo == out_hi) else "uniform, seeded",
        "seed": args.seed,
        "ignore_eos": True,
        "sampling": "greedy",
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": max_model_len,
        "block_size": args.block_size,
        "cuda_graphs": torch.cuda.is_available() and not args.enforce_eager,
        "async_scheduling": config.async_scheduling_on(config.device),
    }
    record = {
        "bench": "offline",
        "host": "H200" if "H200" in device_name else device_name,
        "date": datetime.date.today().isoformat(),
        "command": " ".join([prog, *argv]),
        "model": f"{source.name} shape, {'dummy' if args.load_format == 'dummy' else 'loaded'} {result['info']['dtype']} weights",
        "workload": workload,
        "metrics": result["metrics"],
        "floor": result["floor"],
        "baseline": None,
    }
    name = args.name or f"offline_{source.name}_{args.num_prompts}x{in_hi}in{out_hi}out"
    if args.async_scheduling is not None and not args.name:
        name += "_async" if args.async_scheduling else "_sync"
    os.makedirs(args.results_dir, exist_ok=True)
    path = os.path.join(args.results_dir, f"{name}.json")

    def write() -> None:
        with open(path, "w") as f:
            json.dump(record, f, indent=2, default=float)
            f.write("\n")

    write()
    baseline = None
    if args.baseline_hf:
        try:
            baseline = run_hf_baseline(args, source.path, vocab_size)
        except Exception as exc:  # e.g. out of memory: keep the engine's figures
            logger.exception("transformers baseline failed")
            baseline = {"name": "transformers generate", "error": f"{type(exc).__name__}: {exc}"}
        record["baseline"] = baseline
        write()

    m, fl = result["metrics"], result["floor"]
    print(f"\n== {name} ({device_name}) ==")
    print(f"output tok/s {m['output_tok_s']:,.0f}   total tok/s {m['total_tok_s']:,.0f}   "
          f"elapsed {m['elapsed_s']:.2f} s   floor {fl['elapsed_s']:.2f} s   achieved/floor {fl['achieved_over_floor']:.2f}")
    if "ms_per_decode_step" in m:
        print(f"decode step {m['ms_per_decode_step']:.3f} ms (median {m['ms_per_decode_step_median']:.3f}, "
              f"runner {m['ms_runner_per_decode_step']:.3f}, batch {m['mean_decode_batch']:.1f})   "
              f"floor {fl['ms_per_decode_step']:.3f} ms   floor/achieved {fl['decode_achieved_over_floor']:.2f}")
    if "ms_host_prepare_inputs" in m:
        print(f"decode host ms: prepare {m['ms_host_prepare_inputs']:.3f}, forward launch {m['ms_host_forward_launch']:.3f}, "
              f"wait for GPU {m['ms_wait_for_gpu']:.3f}, scheduler+loop {m['ms_engine_outside_runner']:.3f}")
    if "gpu_idle_fraction" in m:
        print(f"GPU idle in steady decode {100 * m['gpu_idle_fraction']:.1f}% over {m['window_steps']} steps "
              f"(between kernels {100 * m['gpu_idle_between_kernels_fraction']:.1f}%, waiting for the host "
              f"{100 * m['gpu_idle_waiting_host_fraction']:.1f}%), {m['gpu_kernels_per_step']:.0f} kernels/step, "
              f"busy {m['gpu_busy_ms_per_step']:.3f} ms/step")
        for name, ms in m["gpu_top_kernels_ms_per_step"].items():
            print(f"  {ms:7.3f} ms/step  {name}")
    if baseline and "error" not in baseline:
        print(f"transformers: {baseline['output_tok_s']:,.0f} output tok/s, {baseline['ms_per_decode_step']:.2f} ms/step "
              f"({baseline['workload']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(bench_main(prog="python -m bench.offline"))
