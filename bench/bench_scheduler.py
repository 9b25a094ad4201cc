"""Time one scheduler step, schedule() + update_from_output(), with N requests
decoding, against a trivial runner (one token per request, no model).

    .venv/bin/python bench/bench_scheduler.py

Prints a table and writes bench/results/scheduler_step.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_python_description, write_result  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from scheduler.types import EngineCoreRequest, RunnerOutput, SamplingParams, SchedulerOutput  # noqa: E402


def trivial_runner_output(so: SchedulerOutput, token: int) -> RunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return RunnerOutput(req_ids=req_ids, sampled_token_ids=[[token] for _ in req_ids])


def bench(num_reqs: int, prompt_len: int, num_steps: int, block_size: int, prefix_caching: bool, gc_on: bool) -> dict:
    max_model_len = prompt_len + num_steps + 64
    config = SchedulerConfig(
        max_num_seqs=num_reqs,
        max_num_batched_tokens=max(8192, num_reqs),
        max_model_len=max_model_len,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
    )
    num_blocks = num_reqs * (-(-max_model_len // block_size)) + 16
    sched = Scheduler(config, num_blocks)
    for i in range(num_reqs):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]  # distinct prompts
        sched.add_request(
            EngineCoreRequest(f"req-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
        )
    # Prefill until every request decodes (not timed).
    step = 0
    while True:
        so = sched.schedule()
        sched.update_from_output(so, trivial_runner_output(so, step % 1000))
        step += 1
        if len(so.num_scheduled_tokens) == num_reqs and so.total_num_scheduled_tokens == num_reqs:
            break
    gc.collect()
    if not gc_on:
        gc.disable()
    times = []
    try:
        for _ in range(num_steps):
            t0 = time.perf_counter()
            so = sched.schedule()
            t1 = time.perf_counter()
            ro = trivial_runner_output(so, step % 1000)  # not timed: the "model"
            t2 = time.perf_counter()
            outs = sched.update_from_output(so, ro)
            t3 = time.perf_counter()
            assert len(outs) == num_reqs and so.total_num_scheduled_tokens == num_reqs
            times.append(((t1 - t0) + (t3 - t2)) * 1e6)
            step += 1
    finally:
        gc.enable()
    return {
        "num_reqs": num_reqs,
        "us_per_step_median": statistics.median(times),
        "us_per_step_mean": statistics.fmean(times),
        "us_per_step_p99": sorted(times)[int(0.99 * (len(times) - 1))],
        "us_per_req": statistics.median(times) / num_reqs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-reqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scheduler_step.json"))
    args = parser.parse_args()

    caching = not args.no_prefix_caching
    rows = [bench(n, args.prompt_len, args.num_steps, args.block_size, caching, gc_on=True) for n in args.num_reqs]
    rows_nogc = [bench(n, args.prompt_len, args.num_steps, args.block_size, caching, gc_on=False) for n in args.num_reqs]
    print(f"{'running reqs':>12} {'gc':>4} {'median us/step':>15} {'mean':>10} {'p99':>10} {'us/req':>8}")
    for gc_label, rs in (("on", rows), ("off", rows_nogc)):
        for r in rs:
            print(
                f"{r['num_reqs']:>12} {gc_label:>4} {r['us_per_step_median']:>15.1f} {r['us_per_step_mean']:>10.1f} "
                f"{r['us_per_step_p99']:>10.1f} {r['us_per_req']:>8.2f}"
            )
    result = {
        "bench": "scheduler_step",
        "host": cpu_python_description(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "workload": {
            "phase": "all requests decoding, one token each per step",
            "prompt_len": args.prompt_len,
            "num_steps_timed": args.num_steps,
            "block_size": args.block_size,
            "prefix_caching": not args.no_prefix_caching,
            "runner": "trivial (one fixed token per request, not timed)",
            "timed": "schedule() + update_from_output(), median over steps; metrics with the garbage collector on",
        },
        "metrics": {f"us_per_step_{r['num_reqs']}": round(r["us_per_step_median"], 1) for r in rows},
        "details": {"gc_on": rows, "gc_off": rows_nogc},
        "target": {"us_per_step_256": 1000},
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
