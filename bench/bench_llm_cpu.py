"""Offline throughput on the CPU: `LLM.generate` on the embedded
SmolLM2-135M-Instruct (continuous batching, paged KV cache) against
transformers `generate`, one prompt at a time, on the same dequantised
weights, the same chat prompts and the same output token counts.

    .venv/bin/python bench/bench_llm_cpu.py [--num-prompts 32] [--min-tokens 64 --max-tokens 128]

Greedy with ignore_eos, so both do exactly the same work: prompt i generates
min_tokens + (i * 37) % (max_tokens - min_tokens + 1) tokens. Both get one
warm-up call first. Prints a table and writes bench/results/llm_cpu_embedded.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import cpu_description, write_result  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Why is the sky blue?",
    "Explain photosynthesis to a child.", "Give me three tips for better sleep.", "What is a prime number?",
    "Describe a cat in two sentences.", "How do airplanes fly?", "What causes the seasons on Earth?",
    "Suggest a name for a bakery.", "What is the Pythagorean theorem?", "Write a short poem about autumn.",
    "How does a rainbow form?", "What are the benefits of exercise?", "Explain what a computer virus is.",
    "What is the difference between weather and climate?", "Tell me a fun fact about octopuses.",
    "How do I make a cup of tea?", "What is gravity?", "Why do leaves change color in the fall?",
    "Describe the water cycle.", "What is the largest planet in our solar system?",
    "Give me a recipe idea for dinner.", "What does a librarian do?", "How do bees make honey?",
    "What is machine learning?", "Write a limerick about a dog.", "Why is exercise good for the brain?",
    "What is the tallest mountain in the world?", "Explain how a battery works.",
    "What are clouds made of?", "Tell me about the history of the bicycle.",
]


def output_lens(num_prompts: int, lo: int, hi: int) -> list[int]:
    return [lo + (i * 37) % (hi - lo + 1) for i in range(num_prompts)]


def load_hf_gguf(path: str):
    """transformers' GGUF reading and dequantisation, as from_pretrained(gguf_file=...) does."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = dict(load_gguf_checkpoint(path)["config"])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


def run_serval(llm, prompts: list[list[int]], lens: list[int]) -> float:
    from server import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == lens, (got, lens)
    return elapsed


def run_transformers(model, prompts: list[list[int]], lens: list[int], pad_id: int) -> float:
    import torch

    def one(prompt: list[int], n: int) -> int:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=pad_id,
        )
        return out.shape[1] - len(prompt)

    with torch.inference_mode():
        one(prompts[0], 8)  # warm-up
        start = time.perf_counter()
        for prompt, n in zip(prompts, lens):
            assert one(prompt, n) == n
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "llm_cpu_embedded.json"))
    args = ap.parse_args()

    import torch

    from scheduler.config import resolve_model
    from server import LLM

    source = resolve_model(None)
    llm = LLM(max_model_len=1024, kv_cache_memory_gb=0.5, max_num_seqs=args.max_num_seqs, device="cpu")
    tok = llm.get_tokenizer()
    questions = (QUESTIONS * (args.num_prompts // len(QUESTIONS) + 1))[: args.num_prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    lens = output_lens(args.num_prompts, args.min_tokens, args.max_tokens)
    total_out = sum(lens)

    serval_s = run_serval(llm, prompts, lens)
    del llm
    hf = load_hf_gguf(source.path)
    hf_s = run_transformers(hf, prompts, lens, tok.eos_token_id)

    serval_tps, hf_tps = total_out / serval_s, total_out / hf_s
    print(f"\n{'engine':<48} {'time s':>8} {'output tok/s':>13}")
    print(f"{'serval LLM.generate (batched)':<48} {serval_s:>8.2f} {serval_tps:>13.1f}")
    print(f"{'transformers generate, one prompt at a time':<48} {hf_s:>8.2f} {hf_tps:>13.1f}")
    print(f"speed-up {serval_tps / hf_tps:.2f}x; {args.num_prompts} prompts, {total_out} output tokens, "
          f"torch threads {torch.get_num_threads()}")

    result = {
        "bench": "llm_cpu",
        "host": cpu_description(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python bench/bench_llm_cpu.py", *sys.argv[1:]]),
        "model": f"{source.name} (Q4_1 GGUF dequantised to float32), embedded default",
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt": "chat template + one short question",
            "mean_input_len": round(sum(map(len, prompts)) / len(prompts), 1),
            "output_len": [args.min_tokens, args.max_tokens],
            "total_output_tokens": total_out,
            "sampling": "greedy, ignore_eos",
            "max_num_seqs": args.max_num_seqs,
            "torch_threads": torch.get_num_threads(),
        },
        "metrics": {"output_tok_s": round(serval_tps, 2), "elapsed_s": round(serval_s, 2)},
        "baseline": {
            "name": "transformers generate, one prompt at a time",
            "output_tok_s": round(hf_tps, 2),
            "elapsed_s": round(hf_s, 2),
        },
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
