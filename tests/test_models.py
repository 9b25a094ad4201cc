"""models/: the decoder against transformers, the loaders, the shipped configs."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import ModelConfig, RopeScaling, UnsupportedModelError
from models.decoder import WeightLoadError
from models.layers import ops
from models.layers.rotary import rope_inv_freq
from models.loader import load_hf_config, load_model, parse_dtype, resolve_dtype
from models.loader.gguf import unpermute_rope_rows
from models_util import (
    ARCHITECTURES,
    LLAMA3_ROPE_SCALING,
    hf_logits,
    load_hf_model,
    make_tiny_checkpoint,
    make_tiny_gguf,
    run_flat_batch,
    tiny_hf_config,
)
from scheduler.config import ModelSource, resolve_model

# Three requests of different lengths in one flat batch; the longest goes
# past the tiny llama3 rope's original context (64).
PROMPTS = [[3, 17, 99, 4, 250, 7, 8, 100, 200, 300, 11], [5, 6], list(range(40, 140))]

VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": LLAMA3_ROPE_SCALING},
}


def _hf_dir(path) -> ModelSource:
    return ModelSource("hf_dir", str(path), os.path.basename(str(path)))


def _assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


# ---------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(tmp_path, arch, variant):
    path = make_tiny_checkpoint(arch, tmp_path / "ckpt", **VARIANTS[variant])
    model, config = load_model(_hf_dir(path), "auto", None, torch.device("cpu"))
    assert config.architecture == arch
    assert next(model.parameters()).dtype == torch.float32  # "auto" on CPU
    if variant == "tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    _assert_logits_match(run_flat_batch(model, PROMPTS), hf_logits(load_hf_model(path), PROMPTS))


def test_llama_attention_bias_matches_transformers(tmp_path):
    # Llama's attention_bias puts biases on q/k/v and on o_proj.
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt", attention_bias=True)
    model, config = load_model(_hf_dir(path), "auto", None, "cpu")
    assert config.attention_bias and config.o_proj_bias
    _assert_logits_match(run_flat_batch(model, PROMPTS), hf_logits(load_hf_model(path), PROMPTS))


def test_flat_batch_rows_do_not_depend_on_batch_mates(tmp_path):
    path = make_tiny_checkpoint("Qwen3ForCausalLM", tmp_path / "ckpt")
    model, _ = load_model(_hf_dir(path), "auto", None, "cpu")
    batch = run_flat_batch(model, PROMPTS)
    alone = run_flat_batch(model, [PROMPTS[1]])
    n0 = len(PROMPTS[0])
    torch.testing.assert_close(batch[n0 : n0 + len(PROMPTS[1])], alone, rtol=1e-5, atol=1e-5)


def test_sharded_safetensors_load(tmp_path):
    path = make_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "ckpt", num_shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    model, _ = load_model(_hf_dir(path), "auto", None, "cpu")
    _assert_logits_match(run_flat_batch(model, PROMPTS), hf_logits(load_hf_model(path), PROMPTS))


def test_bfloat16_load_casts_weights(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt")
    model, _ = load_model(_hf_dir(path), "auto", torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    logits = run_flat_batch(model, PROMPTS)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(load_hf_model(path), PROMPTS), rtol=0.1, atol=0.3)


# ---------------------------------------------------------------------------
# Load errors name what is wrong
# ---------------------------------------------------------------------------


def _rewrite_checkpoint(path, edit) -> None:
    file = path / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})


def test_missing_weight_is_named(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt")
    _rewrite_checkpoint(path, lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing 1 weight\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(_hf_dir(path), "auto", None, "cpu")


def test_misshapen_weight_is_named(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt")

    def truncate(state):
        name = "model.layers.0.mlp.up_proj.weight"
        state[name] = state[name][:-1].clone()

    _rewrite_checkpoint(path, truncate)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(127, 64\).*expected \(128, 64\)"):
        load_model(_hf_dir(path), "auto", None, "cpu")


def test_unexpected_weight_is_named(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt")
    _rewrite_checkpoint(path, lambda s: s.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2)))
    with pytest.raises(WeightLoadError, match=r"unexpected weight model\.layers\.0\.mlp\.extra_proj\.weight"):
        load_model(_hf_dir(path), "auto", None, "cpu")


def test_unsupported_architecture_lists_supported():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf(GPT2Config(architectures=["GPT2LMHeadModel"]))


def test_unsupported_rope_scaling_is_rejected():
    hf = tiny_hf_config("LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ModelConfig.from_hf(hf)


def test_config_dir_without_dummy_is_refused(tmp_path):
    tiny_hf_config("LlamaForCausalLM").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--load-format dummy"):
        load_model(ModelSource("config_dir", str(tmp_path), "x"), "auto", None, "cpu")


# ---------------------------------------------------------------------------
# ModelConfig
# ---------------------------------------------------------------------------


def test_model_config_from_hf_per_architecture():
    qwen2 = ModelConfig.from_hf(tiny_hf_config("Qwen2ForCausalLM"))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(tiny_hf_config("Qwen3ForCausalLM"))
    assert qwen3.qk_norm and not qwen3.attention_bias
    llama = ModelConfig.from_hf(tiny_hf_config("LlamaForCausalLM", eos_token_id=[2, 7], rope_scaling=LLAMA3_ROPE_SCALING))
    assert llama.eos_token_ids == (2, 7)
    assert llama.rope_scaling == RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    assert (llama.q_size, llama.kv_size) == (64, 32)
    mistral = ModelConfig.from_hf(tiny_hf_config("MistralForCausalLM", sliding_window=32))
    assert mistral.sliding_window == 32


def test_rope_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (LLAMA3_ROPE_SCALING, {"rope_type": "linear", "factor": 4.0}):
        hf = tiny_hf_config("LlamaForCausalLM", rope_scaling=scaling)
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
        config = ModelConfig.from_hf(hf)
        ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
        assert not torch.allclose(ours, rope_inv_freq(config.head_dim, config.rope_theta, None))


def test_rope_freq_factors_reproduce_llama3_scaling():
    # A Llama 3 GGUF keeps the scaling as rope_freqs = default_inv_freq / llama3_inv_freq.
    config = ModelConfig.from_hf(tiny_hf_config("LlamaForCausalLM", rope_scaling=LLAMA3_ROPE_SCALING))
    plain = rope_inv_freq(config.head_dim, config.rope_theta, None)
    llama3 = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    factors = RopeScaling("freq_factors", freq_factors=tuple((plain / llama3).tolist()))
    torch.testing.assert_close(rope_inv_freq(config.head_dim, config.rope_theta, factors), llama3)


def test_dtype_resolution():
    config = ModelConfig.from_hf(tiny_hf_config("LlamaForCausalLM", dtype="bfloat16"))
    assert config.torch_dtype == "bfloat16"
    assert resolve_dtype(None, config, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, config, torch.device("meta")) == torch.bfloat16
    assert resolve_dtype(torch.float16, config, torch.device("cpu")) == torch.float16
    assert parse_dtype("auto") is None and parse_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        parse_dtype("int8")


def test_ops_can_be_swapped_and_restored(tmp_path):
    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ckpt")
    model, _ = load_model(_hf_dir(path), "auto", None, "cpu")
    calls = []
    reference = ops.OPS["silu_and_mul"]
    ops.set_op("silu_and_mul", lambda x: calls.append(x.shape) or reference(x))
    try:
        run_flat_batch(model, [[1, 2, 3]])
    finally:
        ops.reset_ops()
    assert calls == [torch.Size([3, 256])] * 2  # one per layer: [tokens, 2 * intermediate]
    assert ops.OPS["silu_and_mul"] is reference
    with pytest.raises(KeyError, match="unknown op"):
        ops.set_op("gelu", reference)


# ---------------------------------------------------------------------------
# Dummy weights and the shipped benchmark shapes
# ---------------------------------------------------------------------------

# name -> (architecture, parameter count of the published checkpoint, tied)
SHIPPED = {
    "llama-3.1-8b": ("LlamaForCausalLM", 8_030_261_248, False),
    "llama-3.2-1b": ("LlamaForCausalLM", 1_235_814_400, True),
    "qwen3-0.6b": ("Qwen3ForCausalLM", 596_049_920, True),
    "qwen3-8b": ("Qwen3ForCausalLM", 8_190_735_360, False),
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_config_dummy_on_meta(name):
    from transformers import AutoModelForCausalLM

    arch, num_params, tied = SHIPPED[name]
    source = resolve_model(name, load_format="dummy")
    model, config = load_model(source, "dummy", None, torch.device("meta"))
    assert config.architecture == arch and config.tie_word_embeddings == tied
    assert config.torch_dtype == "bfloat16"
    assert next(model.parameters()).dtype == torch.bfloat16  # auto off-CPU: the checkpoint's dtype
    assert sum(p.numel() for p in model.parameters()) == num_params
    if arch == "Qwen3ForCausalLM":
        assert config.head_dim == 128 and config.qk_norm
    else:
        assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"

    hf_config = load_hf_config(source)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf_model.parameters()) == num_params
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == (config.q_size + 2 * config.kv_size, config.hidden_size)


def test_dummy_weights_on_cpu(tmp_path):
    tiny_hf_config("Qwen3ForCausalLM", tie_word_embeddings=True).save_pretrained(tmp_path)
    source = ModelSource("config_dir", str(tmp_path), "tiny")
    model, config = load_model(source, "dummy", torch.bfloat16, "cpu")
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert torch.all(params["model.norm.weight"] == 1)
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"].float()
    assert 0.01 < qkv.std().item() < 0.04
    again, _ = load_model(source, "dummy", torch.bfloat16, "cpu")
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)  # seeded
    logits = run_flat_batch(model, PROMPTS)
    assert logits.shape == (sum(map(len, PROMPTS)), config.vocab_size) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    from models_util import _llama_cpp_permute

    w = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(16, 3).numpy()  # 2 heads of dim 8
    permuted = _llama_cpp_permute(w, 2)
    # head 0 rows [0..7] = halves a=[0,1,2,3], b=[4,5,6,7] are stored interleaved a0 b0 a1 b1 ...
    assert permuted[:8, 0].tolist() == [0, 12, 3, 15, 6, 18, 9, 21]
    assert (unpermute_rope_rows(permuted, 2) == w).all()
    bias = torch.arange(16, dtype=torch.float32).numpy()
    assert (unpermute_rope_rows(_llama_cpp_permute(bias, 2), 2) == bias).all()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_tiny_gguf_matches_transformers(tmp_path, arch):
    # F32 GGUF converted as llama.cpp does: exercises names, metadata and (Llama) the q/k unpermute.
    path = make_tiny_checkpoint(arch, tmp_path / "ckpt", tie_word_embeddings=arch == "Qwen3ForCausalLM")
    gguf_path = make_tiny_gguf(path, tmp_path / "tiny.gguf")
    model, config = load_model(ModelSource("gguf", str(gguf_path), "tiny"), "auto", None, "cpu")
    hf_config = load_hf_config(ModelSource("gguf", str(gguf_path), "tiny"))
    assert hf_config.architectures == [arch]
    assert dataclasses.replace(config, rms_norm_eps=1e-6) == dataclasses.replace(
        ModelConfig.from_hf(tiny_hf_config(arch, tie_word_embeddings=arch == "Qwen3ForCausalLM")),
        rms_norm_eps=1e-6,  # stored as float32 in GGUF
    )
    _assert_logits_match(run_flat_batch(model, PROMPTS), hf_logits(load_hf_model(path), PROMPTS))


@pytest.mark.slow
def test_embedded_gguf_matches_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = resolve_model(None)
    model, config = load_model(source, "auto", None, "cpu")
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "LlamaForCausalLM", 30, 9, 3,
    )
    assert config.tie_word_embeddings

    # transformers' own GGUF reading and dequantisation (from_pretrained(gguf_file=...)
    # would do the same but needs `accelerate`, which Serval does not depend on).
    directory, file = os.path.split(source.path)
    hf_config = AutoConfig.from_pretrained(directory, gguf_file=file)
    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    state = load_gguf_checkpoint(source.path, return_tensors=True, model_to_load=hf_model)["tensors"]
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: the file has no output.weight
    hf_model.load_state_dict(state, strict=True)
    hf_model.eval()

    prompts = [[1, 504, 3458, 314, 260, 2213, 28, 378, 253], [1, 19556, 30]]
    _assert_logits_match(run_flat_batch(model, prompts), hf_logits(hf_model, prompts))
