"""CUDA-graph replay against the eager forward, for every captured batch size
and sizes between them (padded), on a tiny random Llama with the FlashInfer
backend: the same hidden states, the same KV writes, and padded rows writing
only to the padding block."""

from __future__ import annotations

import pytest
import torch

from models.forward_context import ForwardContext, forward_context
from models.layers import ops
from models_util import make_tiny_checkpoint
from runner.attention import AttentionSpec
from test_runner import make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
# head_dim 64: a size FlashInfer compiles for
TINY_GPU = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from models.loader import load_model
    from runner.attention.flashinfer import FlashInferAttentionBackend
    from runner.cuda_graph import CudaGraphRunner
    from runner.cuda_ops import install_cuda_ops
    from scheduler.config import ModelSource

    path = make_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("graph") / "ckpt", seed=3, **TINY_GPU)
    model, config = load_model(ModelSource("hf_dir", str(path), "tiny"), "auto", torch.bfloat16, CUDA)
    install_cuda_ops()
    block_size, num_blocks, max_blocks_per_req = 16, 200, 8
    backend = FlashInferAttentionBackend(CUDA, torch.bfloat16)
    backend.configure(AttentionSpec(4, 2, 64, 64**-0.5, block_size))
    g = torch.Generator(device=CUDA).manual_seed(0)
    kv_caches = [
        torch.randn(num_blocks + 1, 2, block_size, 2, 64, device=CUDA, generator=g).to(torch.bfloat16)
        for _ in range(config.num_layers)
    ]
    graphs = CudaGraphRunner(model, backend, max_num_seqs=24, max_blocks_per_req=max_blocks_per_req,
                             hidden_size=config.hidden_size, dtype=torch.bfloat16, device=CUDA)
    graphs.capture(kv_caches, padding_block_id=num_blocks)
    yield model, backend, graphs, kv_caches, num_blocks, block_size
    ops.reset_ops()


@pytest.mark.parametrize("num_reqs", [1, 2, 3, 4, 5, 8, 9, 16, 17, 23, 24])
def test_graph_replay_matches_eager(setup, num_reqs):
    model, backend, graphs, kv_caches, num_blocks, block_size = setup
    assert graphs.sizes == [1, 2, 4, 8, 16, 24]
    gen = torch.Generator().manual_seed(num_reqs)
    seq_lens = torch.randint(1, 8 * block_size, (num_reqs,), generator=gen).tolist()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[8 * i : 8 * i + (s + block_size - 1) // block_size] for i, s in enumerate(seq_lens)]
    inputs = make_inputs([s - 1 for s in seq_lens], [1] * num_reqs, block_size, tables, 8, CUDA)
    input_ids = torch.randint(0, 512, (num_reqs,), generator=gen).to(CUDA)
    positions = torch.tensor([s - 1 for s in seq_lens], device=CUDA)

    before = [c.clone() for c in kv_caches]
    with torch.inference_mode():
        got = graphs.replay(input_ids, positions, inputs).clone()
    after_graph = [c.clone() for c in kv_caches]
    for c, b in zip(kv_caches, before):
        c.copy_(b)
    with torch.inference_mode():
        meta = backend.build_metadata(inputs)
        with forward_context(ForwardContext(backend, meta, kv_caches)):
            want = model(input_ids, positions)

    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < 1e-2, err
    real_blocks = sorted({t[-1] for t in tables})
    for layer, (g_cache, e_cache, b_cache) in enumerate(zip(after_graph, kv_caches, before)):
        # the real rows' k/v match eager's (GEMMs of another padded size may round differently)
        g_real, e_real = g_cache[real_blocks].double(), e_cache[real_blocks].double()
        assert float((g_real - e_real).norm() / e_real.norm()) < 1e-2, f"layer {layer}"
        # nothing but the blocks of this step's tokens and the padding block changed
        changed = (g_cache != b_cache).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(real_blocks) | {num_blocks}, f"layer {layer}"
