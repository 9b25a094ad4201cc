"""The sampler: filters never leak, penalties/bias are exact, min_tokens,
seeds independent of the batch, greedy, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.input_batch import SamplingColumns
from runner.sampler import Sampler, SamplingMetadata
from scheduler.types import NewRequestData, SamplingParams

CPU = torch.device("cpu")
EOS = 0


def make_meta(params: list[SamplingParams], prompts=None, outputs=None, eos_token_id=None) -> SamplingMetadata:
    n = len(params)
    prompts = prompts or [[1]] * n
    outputs = outputs or [[]] * n
    cols = SamplingColumns.allocate(n)
    for i, p in enumerate(params):
        req = NewRequestData(
            req_id=str(i),
            prompt_token_ids=list(prompts[i]),
            output_token_ids=list(outputs[i]),
            sampling_params=p,
            block_ids=[],
            num_computed_tokens=0,
            eos_token_id=eos_token_id,
        )
        cols.write(i, req)
    num_prompt = np.array([len(p) for p in prompts], dtype=np.int32)
    num_tokens = num_prompt + np.array([len(o) for o in outputs], dtype=np.int32)
    token_ids = np.zeros((n, int(num_tokens.max())), dtype=np.int32)
    for i in range(n):
        seq = list(prompts[i]) + list(outputs[i])
        token_ids[i, : len(seq)] = seq
    return SamplingMetadata(cols, num_prompt, num_tokens, token_ids, np.arange(n))


def logits_from_probs(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log().expand(n, -1).clone()


def sample_many(params: SamplingParams, probs: list[float], n: int = 4000, seed: int = 0) -> np.ndarray:
    sampler = Sampler([EOS], CPU, seed=seed)
    out = sampler(logits_from_probs(probs, n), make_meta([params] * n))
    return out.sampled_token_ids.numpy()


# ---------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------

PROBS = [0.05, 0.3, 0.2, 0.15, 0.12, 0.1, 0.05, 0.03]  # token 1 most likely


def test_plain_sampling_follows_the_distribution():
    draws = sample_many(SamplingParams(temperature=1.0), PROBS, n=20000)
    freq = np.bincount(draws, minlength=len(PROBS)) / len(draws)
    np.testing.assert_allclose(freq, PROBS, atol=0.015)


def test_top_k_never_leaves_the_top_k():
    draws = sample_many(SamplingParams(temperature=1.0, top_k=3), PROBS)
    assert set(draws.tolist()) == {1, 2, 3}
    # renormalised over the kept tokens: 0.3/0.65, 0.2/0.65, 0.15/0.65
    freq = np.bincount(draws, minlength=len(PROBS))[[1, 2, 3]] / len(draws)
    np.testing.assert_allclose(freq, np.array([0.3, 0.2, 0.15]) / 0.65, atol=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # sorted mass: 0.3, 0.5, 0.65, 0.77 ... -> top_p=0.6 keeps {1, 2, 3}
    draws = sample_many(SamplingParams(temperature=1.0, top_p=0.6), PROBS)
    assert set(draws.tolist()) == {1, 2, 3}
    draws = sample_many(SamplingParams(temperature=1.0, top_p=0.25), PROBS)
    assert set(draws.tolist()) == {1}


def test_min_p_drops_tokens_below_fraction_of_max():
    # threshold 0.45 * 0.3 = 0.135 -> keep {1, 2, 3}
    draws = sample_many(SamplingParams(temperature=1.0, min_p=0.45), PROBS)
    assert set(draws.tolist()) == {1, 2, 3}


def test_filters_combined_with_temperature():
    # high temperature flattens, but top_k=4 and top_p still bound the set
    draws = sample_many(SamplingParams(temperature=3.0, top_k=4, top_p=0.9), PROBS)
    assert set(draws.tolist()) <= {1, 2, 3, 4}
    assert len(set(draws.tolist())) >= 3


def test_mixed_rows_each_get_their_own_filter():
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, min_p=0.9),
              SamplingParams(temperature=1.0)]
    n = 1500
    sampler = Sampler([EOS], CPU)
    out = sampler(logits_from_probs(PROBS, 3 * n), make_meta(params * n)).sampled_token_ids.numpy()
    assert set(out[0::3].tolist()) == {1, 2}
    assert set(out[1::3].tolist()) == {1}
    assert len(set(out[2::3].tolist())) == len(PROBS)


def reference_kept(logits: np.ndarray, top_k: int, top_p: float) -> set[int]:
    order = np.argsort(-logits, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    probs = np.exp(logits[order] - logits[order].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    return set(order[(mass_before < top_p) | (np.arange(len(order)) == 0)].tolist())


@pytest.mark.parametrize("sync_free", [False, True])  # the CPU's candidates-first path, the GPU's full sort
@pytest.mark.parametrize("scale", [0.5, 8.0])  # flat (cut past the candidates) and peaked
def test_top_k_top_p_kept_sets_match_a_full_sort(scale, sync_free):
    from runner.sampler import _top_k_top_p

    g = torch.Generator().manual_seed(5)
    vocab = 3000
    logits = torch.randn(6, vocab, generator=g, dtype=torch.float64).float() * scale
    top_k = np.array([0, 0, 50, 2000, 0, 1500], dtype=np.int32)
    top_p = np.array([0.9, 0.3, 0.8, 0.95, 0.999, 1.0], dtype=np.float32)
    out = _top_k_top_p(logits.clone(), top_k, top_p, sync_free=sync_free)
    for i in range(6):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == reference_kept(logits[i].double().numpy(), int(top_k[i]), float(top_p[i]))
        torch.testing.assert_close(out[i][list(kept)], logits[i][list(kept)])


# ---------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 100, generator=g)
    params = [SamplingParams(temperature=0.0)] * 8 + [SamplingParams(temperature=0.7, top_k=1)] * 8
    out = Sampler([EOS], CPU)(logits, make_meta(params)).sampled_token_ids
    assert torch.equal(out, logits.argmax(-1))


# ---------------------------------------------------------------------------
# Penalties, bias, min_tokens: exact numbers
# ---------------------------------------------------------------------------


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]])
    meta = make_meta([SamplingParams(repetition_penalty=2.0)], prompts=[[1, 2]], outputs=[[2, 4, 4]])
    out = Sampler([EOS], CPU).process_logits(logits.clone(), meta)
    # seen: 1 (neg, *2), 2 (pos, /2), 4 (pos, /2); 0, 3, 5 untouched
    expected = torch.tensor([[2.0, -2.0, 0.25, -3.0, 0.5, 4.0]])
    torch.testing.assert_close(out, expected)


def test_frequency_and_presence_over_output_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]])
    meta = make_meta(
        [SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)],
        prompts=[[5, 5, 1]],  # prompt tokens are not penalised
        outputs=[[2, 4, 4, 4]],
    )
    out = Sampler([EOS], CPU).process_logits(logits.clone(), meta)
    # 2: count 1 -> -0.5 - 1.5; 4: count 3 -> -1.5 - 1.5
    expected = torch.tensor([[2.0, -1.0, 0.5 - 2.0, -3.0, 1.0 - 3.0, 4.0]])
    torch.testing.assert_close(out, expected)


def test_penalties_only_touch_their_rows():
    logits = torch.arange(12, dtype=torch.float32).view(2, 6) - 3
    meta = make_meta(
        [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2), SamplingParams()],
        prompts=[[1], [1]],
        outputs=[[3, 3], [3, 3]],
    )
    out = Sampler([EOS], CPU).process_logits(logits.clone(), meta)
    torch.testing.assert_close(out[1], logits[1])
    exp0 = logits[0].clone()
    exp0[1] = exp0[1] * 1.3  # -2 (negative): multiplied
    exp0[3] = exp0[3] / 1.3 - 0.2 * 2  # 0 -> 0, then frequency
    torch.testing.assert_close(out[0], exp0)


def test_logit_bias_is_added():
    logits = torch.zeros(2, 5)
    meta = make_meta([SamplingParams(logit_bias={1: 3.5, 4: -100.0}), SamplingParams(logit_bias={99: 1.0})])
    out = Sampler([EOS], CPU).process_logits(logits.clone(), meta)
    torch.testing.assert_close(out[0], torch.tensor([0.0, 3.5, 0.0, 0.0, -100.0]))
    torch.testing.assert_close(out[1], torch.zeros(5))  # out-of-vocab ids are ignored
    # a bias makes greedy pick the token
    meta = make_meta([SamplingParams(temperature=0.0, logit_bias={3: 5.0})])
    assert Sampler([EOS], CPU)(torch.zeros(1, 5), meta).sampled_token_ids.item() == 3


def test_min_tokens_suppresses_eos_and_stop_ids():
    # EOS (0) is the argmax, stop id 2 second
    logits = torch.tensor([[9.0, 1.0, 8.0, 3.0]]).expand(4, -1).clone()
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]),  # 1 output: masked
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2]),  # 3 outputs: free
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[5], [5, 5, 5], [5], [5]]
    sampler = Sampler([EOS], CPU)
    tokens = sampler(logits, make_meta(params, outputs=outputs)).sampled_token_ids.tolist()
    assert tokens == [3, 0, 0, 0]
    # sampled (not greedy) draws never hit EOS or the stop id either
    n = 2000
    draws = sampler(
        torch.zeros(n, 4), make_meta([SamplingParams(min_tokens=2, stop_token_ids=[2])] * n)
    ).sampled_token_ids
    assert set(draws.tolist()) == {1, 3}


def test_min_tokens_masks_the_request_eos_too():
    # the request's EOS (e.g. from generation_config) is 3, the model's is 0
    logits = torch.tensor([[1.0, 2.0, 0.0, 9.0]]).expand(3, -1).clone()
    params = [SamplingParams(temperature=0.0, min_tokens=2)] * 2 + [
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    ]
    meta = make_meta(params, outputs=[[5], [5, 5], [5]], eos_token_id=3)
    assert Sampler([EOS], CPU)(logits, meta).sampled_token_ids.tolist() == [1, 3, 3]


# ---------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_seeded_rows_do_not_depend_on_the_batch(device):
    device = torch.device(device)
    g = torch.Generator().manual_seed(7)
    vocab = 64
    target_logits = torch.randn(vocab, generator=g)
    target = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)

    def run(batch_params, position, sampler_seed, num_outputs):
        n = len(batch_params) + 1
        logits = torch.randn(n, vocab, generator=g)
        logits[position] = target_logits
        params = list(batch_params)
        params.insert(position, target)
        outs = [[3] * num_outputs] * n
        out = Sampler([EOS], device, seed=sampler_seed)(logits.to(device), make_meta(params, outputs=outs))
        return out.sampled_token_ids[position].item()

    busy = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, seed=99),
            SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=5),
            SamplingParams(temperature=1.0, seed=1234 + 1)]
    for num_outputs in range(6):
        alone = run([], 0, 0, num_outputs)
        assert run(busy, 2, 123, num_outputs) == alone
        assert run(busy[:2], 1, 5, num_outputs) == alone
        assert run(busy * 3, 15, 9, num_outputs) == alone
    # the seed stream moves with the output position
    draws = {run([], 0, 0, k) for k in range(30)}
    assert len(draws) > 5


def test_unseeded_rows_vary_and_seeded_differ_by_seed():
    logits = torch.zeros(200, 50)
    out = Sampler([EOS], CPU)(logits, make_meta([SamplingParams()] * 200)).sampled_token_ids
    assert len(set(out.tolist())) > 20
    seeded = [SamplingParams(seed=s) for s in range(200)]
    out = Sampler([EOS], CPU)(logits, make_meta(seeded)).sampled_token_ids
    assert len(set(out.tolist())) > 20


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------


def test_logprobs_values_and_rank():
    g = torch.Generator().manual_seed(3)
    n, vocab = 64, 30
    logits = torch.randn(n, vocab, generator=g) * 2
    params = [SamplingParams(temperature=1.0, logprobs=4)] * (n - 2) + [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = Sampler([EOS], CPU)(logits, make_meta(params))
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[-1] is None
    ranks = set()
    for i in range(n - 1):
        lp = out.logprobs[i]
        tok = out.sampled_token_ids[i].item()
        assert lp.token_ids[0] == tok
        assert lp.logprobs[0] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        ranks.add(lp.rank)
        top = ref[i].topk(4)
        want_n = params[i].logprobs
        assert lp.token_ids[1:] == top.indices.tolist()[:want_n]
        np.testing.assert_allclose(lp.logprobs[1:], top.values.tolist()[:want_n], atol=1e-5)
    assert out.logprobs[n - 2].rank == 1 and len(out.logprobs[n - 2].token_ids) == 1
    assert len(ranks) > 1  # sampled rows do pick non-argmax tokens


def test_logprobs_are_raw_by_default_or_after_penalties_before_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    params = [SamplingParams(temperature=0.5, repetition_penalty=2.0, logprobs=1)]
    meta = make_meta(params, prompts=[[2]])
    out = Sampler([EOS], CPU, logprobs_mode="processed")(logits, meta)
    processed = torch.tensor([[1.0, 2.0, 1.5, 0.5]])  # token 2 divided by 2, no temperature
    ref = torch.log_softmax(processed, -1)[0]
    assert out.logprobs[0].token_ids[1] == 1
    assert out.logprobs[0].logprobs[1] == pytest.approx(ref[1].item(), abs=1e-6)
    raw = Sampler([EOS], CPU)(logits, meta)
    assert raw.logprobs[0].token_ids[1] == 2
    assert raw.logprobs[0].logprobs[1] == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item(), abs=1e-6)
