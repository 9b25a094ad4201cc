"""Guided decoding cost, in-process engine (`LLM`), on any device.

    .venv/bin/python bench/bench_structured.py [--device auto] [--model PATH] [--out FILE]

1. mask fill: the runner's GrammarMatchers filling the token bitmasks of a
   batch of guided requests (xgrammar, on the CPU), and applying them to
   [batch, vocab] logits on the device; per token per request, at several
   batch sizes. Each step advances every matcher by a token its mask allows.
2. end to end: 32 requests decoding 64 tokens each (greedy), none guided
   against half guided by a JSON schema (whose outputs are longer than 64
   tokens, so both runs decode exactly 32 x 64 tokens); time per output token.

Writes bench/results/structured_<device>.json ({"bench", "host", "date",
"command", "model", "workload", "metrics"}). Default model: the embedded
SmolLM2-135M-Instruct (49,152-token vocabulary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_description, write_result  # noqa: E402

# outputs longer than the 64 decoded tokens: every guided request runs to max_tokens
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "items": {
            "type": "array", "minItems": 8, "maxItems": 8,
            "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                        "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
                      "required": ["name", "qty"]},
        },
    },
    "required": ["title", "items"],
}
QUESTIONS = [
    "List some groceries as JSON.", "Describe a library as JSON.", "Plan a picnic as JSON.",
    "Make a packing list as JSON.", "Name some tools as JSON.", "Write an inventory as JSON.",
    "List kitchen items as JSON.", "Describe a garden as JSON.",
]


def host_description() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return cpu_description()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_mask_fill(llm, batch_sizes: list[int], steps: int) -> dict[str, dict[str, float]]:
    import torch

    from runner.structured_output import GrammarMatchers, apply_token_bitmask
    from scheduler.types import NewRequestData, SamplingParams, StructuredOutputSpec

    runner = llm.engine.engine_core.runner
    device, vocab = runner.device, llm.info.vocab_size
    spec = StructuredOutputSpec("json", json.dumps(LONG_SCHEMA))
    cache = runner.grammar_matchers.cache
    cache.get_or_compile(spec)
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(structured_output=spec)
    gen = torch.Generator(device=device).manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for bs in batch_sizes:
        matchers = GrammarMatchers(cache, vocab, max(batch_sizes), device)
        ids = [f"r{i}" for i in range(bs)]

        def add(req_id: str) -> None:
            matchers.add_request(NewRequestData(req_id, [1], [], params, [0], 0, eos_token_id=eos))

        for r in ids:
            add(r)
        fill_s, apply_s = [], []
        for step in range(steps):
            logits = torch.randn(bs, vocab, device=device, generator=gen)
            _sync(device)
            t0 = time.perf_counter()
            rows, bitmask = matchers.fill_bitmask(ids)
            t1 = time.perf_counter()
            apply_token_bitmask(logits, bitmask, torch.from_numpy(rows).to(device))
            _sync(device)
            t2 = time.perf_counter()
            if step >= 2:  # warm-up
                fill_s.append(t1 - t0)
                apply_s.append(t2 - t1)
            tokens = logits.argmax(dim=-1).tolist()
            matchers.accept(ids, tokens)
            for r, t in zip(ids, tokens):
                if t == eos:  # finished: start over
                    matchers.remove_request(r)
                    add(r)
        results[str(bs)] = {
            "fill_us_per_token_per_request": round(statistics.median(fill_s) / bs * 1e6, 2),
            "apply_us_per_token_per_request": round(statistics.median(apply_s) / bs * 1e6, 2),
            "fill_ms_per_step": round(statistics.median(fill_s) * 1e3, 3),
            "apply_ms_per_step": round(statistics.median(apply_s) * 1e3, 3),
        }
        print(f"batch {bs:3d}: fill {results[str(bs)]['fill_us_per_token_per_request']:8.1f} us/token/request, "
              f"apply {results[str(bs)]['apply_us_per_token_per_request']:8.1f} us/token/request")
    return results


def run_end_to_end(llm, num_requests: int, output_len: int, guided_fraction: float) -> tuple[float, int]:
    """One timed LLM.generate of the batch: (elapsed seconds, output tokens)."""
    from scheduler.types import SamplingParams, StructuredOutputSpec

    spec = StructuredOutputSpec("json", json.dumps(LONG_SCHEMA))
    num_guided = int(num_requests * guided_fraction)
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(num_requests)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=output_len, structured_output=spec) if i % 2 == 0 and i // 2 < num_guided
        else SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        for i in range(num_requests)
    ]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params[:4], use_tqdm=False)  # warm-up
    llm.engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    for o, p in zip(outs, params):
        assert p.structured_output is None or o.outputs[0].text.startswith('{"title": "'), o.outputs[0].text
    print(f"{num_guided:2d}/{num_requests} guided: {elapsed / num_tokens * 1e3:.3f} ms/output token "
          f"({num_tokens} tokens in {elapsed:.2f} s)")
    return elapsed, num_tokens


def bench_end_to_end(llm, num_requests: int, output_len: int, repeats: int) -> dict[str, dict[str, float]]:
    """None guided against half guided, alternated `repeats` times; the
    median of each (the CPU may be shared: alternating spreads the noise)."""
    runs: dict[float, list[tuple[float, int]]] = {0.0: [], 0.5: []}
    for _ in range(repeats):
        for fraction in runs:
            runs[fraction].append(run_end_to_end(llm, num_requests, output_len, fraction))
    out = {}
    for fraction, name in ((0.0, "none_guided"), (0.5, "half_guided")):
        elapsed = statistics.median(e for e, _ in runs[fraction])
        num_tokens = runs[fraction][0][1]
        out[name] = {
            "num_guided": int(num_requests * fraction),
            "output_tokens": num_tokens,
            "elapsed_s_median": round(elapsed, 3),
            "elapsed_s_runs": [round(e, 3) for e, _ in runs[fraction]],
            "ms_per_output_token": round(elapsed / num_tokens * 1e3, 3),
            "output_tok_s": round(num_tokens / elapsed, 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (a config dir with a tokenizer)")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--fill-steps", type=int, default=50)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: bench/results/structured_<device>.json")
    args = ap.parse_args()

    import torch

    from server import LLM

    llm = LLM(args.model, device=args.device, load_format=args.load_format,
              max_num_seqs=max(32, args.num_requests), kv_cache_memory_gb=0.5)
    device = llm.info.device.split(":")[0]
    print(f"{llm.info.model} on {llm.info.device} ({llm.info.dtype}), vocab {llm.info.vocab_size}, "
          f"torch threads {torch.get_num_threads()}")
    fill = bench_mask_fill(llm, [int(b) for b in args.batch_sizes.split(",")], args.fill_steps)
    e2e = bench_end_to_end(llm, args.num_requests, args.output_len, args.repeats)
    none, half = e2e["none_guided"], e2e["half_guided"]
    result = {
        "bench": "structured",
        "host": host_description(),
        "date": datetime.date.today().isoformat(),
        "command": "python bench/bench_structured.py " + " ".join(sys.argv[1:]),
        "model": f"{llm.info.model} ({llm.info.dtype}, vocab {llm.info.vocab_size}"
                 + (", dummy random weights)" if args.load_format == "dummy" else ")"),
        "workload": {
            "mask_fill": {"schema": "object with a string and 8 {name, qty} items", "batch_sizes": [int(b) for b in fill],
                          "steps": args.fill_steps},
            "end_to_end": {"num_requests": args.num_requests, "output_len": args.output_len, "sampling": "greedy",
                           "guided": "half of the batch, same schema (outputs cut at output_len)",
                           "free": "ignore_eos", "repeats": args.repeats},
            "device": llm.info.device,
            "torch_threads": torch.get_num_threads(),
        },
        "metrics": {
            "mask_fill_by_batch_size": fill,
            "end_to_end_none_guided": none,
            "end_to_end_half_guided": half,
            "guided_overhead_per_output_token_pct": round(
                (half["ms_per_output_token"] / none["ms_per_output_token"] - 1) * 100, 1),
        },
    }
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"structured_{device}.json")
    write_result(out, result)


if __name__ == "__main__":
    main()
