"""The whole engine (build_engine_core: loader, KV cache, runner on the torch
backend, scheduler) against transformers, on tiny random checkpoints of each
architecture: greedy tokens identical to `generate(do_sample=False)`, and
logprobs (the log-softmaxed logits) within tolerance at every step.

Small block_size and max_num_batched_tokens make chunked prefill, mixed
prefill/decode steps and multi-block requests the common case; a tiny KV
cache forces preemption and recomputation; a second wave reuses the prefix
cache.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from models_util import ARCHITECTURES, load_hf_model, make_tiny_checkpoint
from runner.engine import build_engine_core
from scheduler.config import EngineConfig
from scheduler.types import EngineCoreRequest, SamplingParams

MAX_TOKENS = 12
NUM_TOP = 5
ATOL = 2e-4

_rng = random.Random(0)
SHARED_PREFIX = [_rng.randrange(3, 512) for _ in range(13)]
PROMPTS = [
    [_rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 1, 11)
] + [SHARED_PREFIX + [7, 8, 9]]
SECOND_WAVE = [SHARED_PREFIX + [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch) / "ckpt", seed=1)
    hf = load_hf_model(path)
    refs = {}
    for prompt in PROMPTS + SECOND_WAVE:
        refs[tuple(prompt)] = hf_greedy(hf, prompt)
    return path, refs


@torch.inference_mode()
def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    device = next(hf.parameters()).device
    out = hf.generate(
        torch.tensor([prompt], device=device),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == MAX_TOKENS, "transformers stopped early"
    logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1).cpu()  # [MAX_TOKENS, vocab]
    return tokens, logprobs


def small_config(path, **overrides) -> EngineConfig:
    """Block size 4, 16 tokens a step, 8 sequences: chunked prefill, mixed
    steps and multi-block requests are the common case."""
    return EngineConfig(model=str(path), block_size=4, max_num_batched_tokens=16, max_num_seqs=8, **overrides)


def run_engine(config: EngineConfig, waves: list[list[list[int]]]):
    core, info = build_engine_core(config)
    results = {}
    next_id = 0
    for wave in waves:
        ids = {}
        for prompt in wave:
            req_id = f"r{next_id}"
            next_id += 1
            ids[req_id] = prompt
            core.add_request(
                EngineCoreRequest(
                    req_id=req_id,
                    prompt_token_ids=prompt,
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=NUM_TOP),
                    eos_token_id=None,
                )
            )
        tokens, logprobs, cached = defaultdict(list), defaultdict(list), {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                tokens[out.req_id] += out.new_token_ids
                logprobs[out.req_id] += out.new_logprobs or []
                cached[out.req_id] = out.num_cached_tokens
        for req_id, prompt in ids.items():
            results[tuple(prompt)] = (tokens[req_id], logprobs[req_id], cached[req_id])
    return results, core, info


def check_against_hf(results, refs):
    for prompt, (tokens, logprobs, _) in results.items():
        ref_tokens, ref_lp = refs[prompt]
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert len(logprobs) == MAX_TOKENS
        for step, lp in enumerate(logprobs):
            want = ref_lp[step]
            assert lp.token_ids[0] == tokens[step] and lp.rank == 1
            assert lp.token_ids[1:] == want.topk(NUM_TOP).indices.tolist()
            torch.testing.assert_close(torch.tensor(lp.logprobs[1:]), want.topk(NUM_TOP).values, atol=ATOL, rtol=0)
        # the last step's full distribution's head, once more by value
        assert lp.logprobs[0] == pytest.approx(float(ref_lp[-1, tokens[-1]]), abs=ATOL)


def test_engine_matches_transformers(checkpoint):
    path, refs = checkpoint
    config = small_config(path, device="cpu", num_gpu_blocks_override=128)
    results, core, info = run_engine(config, [PROMPTS, SECOND_WAVE])
    check_against_hf(results, refs)
    assert info.max_model_len == 256 and info.num_blocks == 128
    # the second wave found the shared prefix's full blocks in the cache
    assert results[tuple(SECOND_WAVE[0])][2] >= 12


def test_engine_matches_transformers_under_preemption(checkpoint):
    path, refs = checkpoint
    config = small_config(
        path,
        device="cpu",
        num_gpu_blocks_override=14,  # 56 tokens for ~100 live ones: preemption
        enable_prefix_caching=False,
    )
    results, core, info = run_engine(config, [PROMPTS])
    check_against_hf(results, refs)
    assert info.max_model_len == 56
    assert core.make_stats().num_preemptions_total > 0


@pytest.mark.gpu
def test_engine_matches_transformers_on_cuda(tmp_path):
    """The same engine on a GPU, with the torch backend, float32, against
    transformers on the same GPU."""
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt", seed=1)
    hf = load_hf_model(path).to("cuda")
    refs = {tuple(p): hf_greedy(hf, p) for p in PROMPTS + SECOND_WAVE}
    config = small_config(path, device="cuda", dtype="float32", attention_backend="torch", num_gpu_blocks_override=20)
    results, core, info = run_engine(config, [PROMPTS, SECOND_WAVE])
    check_against_hf(results, refs)
    assert info.device.startswith("cuda")
    assert core.make_stats().num_preemptions_total > 0
