"""Host time per engine step, with the device work taken out.

    .venv/bin/python bench/bench_host_overhead.py [--label before|after]

Builds the real `ModelRunner` and `EngineCore` on the CPU around a model whose
forward is trivially cheap (an embedding lookup and a [hidden, vocab] head,
hidden 64) and an attention backend that does nothing, so what is timed is the
host work a GPU step waits for: scheduling, applying the scheduler's diff to
the persistent batch, preparing the step's inputs, launching the forward,
sampling and bookkeeping. max_model_len is the serve default (131,072), so the
block table has the width a served model has.

256 requests are added, prefilled (untimed), then N decode steps are timed,
split as
    scheduler  schedule() + update_from_output()
    update     ModelRunner._update_batch (the scheduler's diff into the batch)
    prepare    ModelRunner._prepare_inputs
    forward    ModelRunner._forward (the fake model: nearly all launch overhead)
    sample     the rest of execute(): logits, sampling metadata, sampler,
               appending the sampled tokens, building the RunnerOutput
Prints a table; with --label, records the run under that label in
bench/results/host_overhead_cpu.json (other labels' runs are kept).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import cpu_python_description, write_result  # noqa: E402
from runner.attention import AttentionInputs, RunnerAttentionBackend  # noqa: E402
from runner.model_runner import ModelRunner, cdiv  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine_core import EngineCore  # noqa: E402
from scheduler.types import EngineCoreRequest, SamplingParams  # noqa: E402

try:  # what the engine loop calls after start-up (absent in revisions before it)
    from scheduler.engine_core import freeze_gc_after_startup  # noqa: E402
except ImportError:
    freeze_gc_after_startup = None

PARTS = ("scheduler", "update", "prepare", "forward", "sample")


class NoopBackend(RunnerAttentionBackend):
    name = "noop"

    def build_metadata(self, inputs: AttentionInputs) -> None:
        return None

    def forward(self, layer, q, k, v, kv_cache, meta):  # never called: the model has no attention
        raise AssertionError


class CheapModel(nn.Module):
    """input ids -> embedding [num_tokens, hidden] -> logits [n, vocab]."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class StepTimer:
    """Wraps runner methods on the instance and the scheduler's two calls;
    accumulates seconds per part for the current step."""

    def __init__(self, core: EngineCore, runner: ModelRunner):
        self.cur: dict[str, float] = {}
        for obj, method, part in (
            (core.scheduler, "schedule", "scheduler"),
            (core.scheduler, "update_from_output", "scheduler"),
            (runner, "_update_batch", "update"),
            (runner, "_prepare_inputs", "prepare"),
            (runner, "_forward", "forward"),
            (runner, "execute", "execute"),
        ):
            setattr(obj, method, self._timed(getattr(obj, method), part))

    def _timed(self, fn, part: str):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cur[part] = self.cur.get(part, 0.0) + time.perf_counter() - t0

        return wrapper


def build(
    num_reqs: int, max_model_len: int, block_size: int, prompt_len: int, num_steps: int, vocab: int, gc_freeze: bool
):
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = CheapModel(vocab, 64).eval()
    backend = NoopBackend(device, torch.float32)
    blocks_per_req = cdiv(prompt_len + num_steps + 64, block_size)
    num_blocks = num_reqs * blocks_per_req + 16
    runner = ModelRunner(
        model,
        [],
        backend,
        block_size=block_size,
        max_num_seqs=num_reqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=8192,
        device=device,
        eos_token_ids=(2,),
    )
    config = SchedulerConfig(
        max_num_seqs=num_reqs, max_num_batched_tokens=8192, max_model_len=max_model_len, block_size=block_size
    )
    core = EngineCore(config, runner, num_blocks)
    if gc_freeze and freeze_gc_after_startup is not None:
        freeze_gc_after_startup()
    for i in range(num_reqs):
        prompt = [(i * 7919 + j) % vocab for j in range(prompt_len)]
        core.add_request(
            EngineCoreRequest(f"req-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
        )
    return core, runner


def run(args) -> dict:
    core, runner = build(
        args.num_reqs, args.max_model_len, args.block_size, args.prompt_len, args.num_steps, args.vocab,
        gc_freeze=not args.no_gc_freeze,
    )
    # prefill until every request decodes (untimed)
    while True:
        core.step()
        if runner.batch.num_reqs == args.num_reqs and (runner.batch.num_computed_tokens[: args.num_reqs] >= args.prompt_len).all():
            break
    for _ in range(20):  # warm-up decode steps
        core.step()
    timer = StepTimer(core, runner)
    gc.collect()
    per_part: dict[str, list[float]] = {p: [] for p in PARTS + ("total",)}
    for _ in range(args.num_steps):
        timer.cur = {}
        t0 = time.perf_counter()
        outputs = core.step()
        total = time.perf_counter() - t0
        assert len(outputs.outputs) == args.num_reqs
        c = timer.cur
        sample = c["execute"] - c["update"] - c["prepare"] - c["forward"]
        for part, secs in (
            ("scheduler", c["scheduler"]),
            ("update", c["update"]),
            ("prepare", c["prepare"]),
            ("forward", c["forward"]),
            ("sample", sample),
            ("total", total),
        ):
            per_part[part].append(secs * 1e6)
    return {
        part: {
            "median_us": round(statistics.median(v), 1),
            "mean_us": round(statistics.fmean(v), 1),
            "p99_us": round(sorted(v)[int(0.99 * (len(v) - 1))], 1),
            "max_us": round(max(v), 1),
        }
        for part, v in per_part.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-reqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--num-steps", type=int, default=500)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--no-gc-freeze", action="store_true", help="skip freeze_gc_after_startup()")
    parser.add_argument("--label", default=None, help="record the run under this label (e.g. before, after)")
    parser.add_argument("--revision", default=None, help="what code ran (recorded with the label)")
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host_overhead_cpu.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    res = run(args)
    print(f"{args.num_reqs} requests decoding, max_model_len {args.max_model_len}, {args.num_steps} steps")
    print(f"{'part':>10} {'median us':>10} {'mean us':>10} {'p99 us':>10} {'max us':>10}")
    for part, r in res.items():
        print(f"{part:>10} {r['median_us']:>10.1f} {r['mean_us']:>10.1f} {r['p99_us']:>10.1f} {r['max_us']:>10.1f}")
    if args.label is None:
        return

    result = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    runs = result.get("runs", {})
    runs[args.label] = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "revision": args.revision,
        "gc_freeze": freeze_gc_after_startup is not None and not args.no_gc_freeze,
        "us_per_step": res,
    }
    result = {
        "bench": "host_overhead",
        "host": cpu_python_description(),
        "date": datetime.date.today().isoformat(),
        "command": ".venv/bin/python bench/bench_host_overhead.py --label LABEL",
        "workload": {
            "num_reqs": args.num_reqs,
            "phase": "all requests decoding, one token each per step (greedy, ignore_eos)",
            "max_model_len": args.max_model_len,
            "block_size": args.block_size,
            "prompt_len": args.prompt_len,
            "num_steps_timed": args.num_steps,
            "model": f"embedding + head, hidden 64, vocab {args.vocab}; attention backend a no-op",
            "note": "forward and sample include the fake model's CPU compute (embedding, [64, vocab] head, argmax), "
            "which on a GPU are kernel launches",
            "timed": "EngineCore.step() split into scheduler / update / prepare / forward / sample, per-step median",
            "torch_threads": 1,
        },
        "metrics": {
            f"{label}_{part}_us": r["us_per_step"][part]["median_us"] for label, r in runs.items() for part in PARTS + ("total",)
        },
        "runs": runs,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
