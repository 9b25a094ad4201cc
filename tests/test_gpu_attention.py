"""The FlashInfer backend against the torch backend and a float64 dense
reference, on random paged caches: prefill, decode, mixed, chunked prefill,
block sizes 1/16/32, GQA and MHA, head_dim 64 and 128, bfloat16.
Also the Triton ops against their torch references."""

from __future__ import annotations

import pytest
import torch

from models.layers import ops
from runner.attention import AttentionSpec
from test_runner import FakeLayer, dense_attention, make_inputs, random_paged_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
DTYPE = torch.bfloat16

CASES = {
    "prefill": ([0, 0, 0], [5, 1, 37]),
    "decode": ([3, 40, 0, 17, 100, 31], [1, 1, 1, 1, 1, 1]),
    # the same batch on FlashInfer's CUDA-core decode kernel (tensor cores switched off for it)
    "decode_cuda_cores": ([3, 40, 0, 17, 100, 31], [1, 1, 1, 1, 1, 1]),
    # and on the one-launch Triton kernel for small decode batches (triton_decode.py)
    "decode_triton": ([3, 40, 0, 17, 100, 31], [1, 1, 1, 1, 1, 1]),
    "mixed": ([0, 9, 5, 17], [7, 1, 6, 1]),
    "chunked": ([16, 33, 0], [16, 9, 20]),
}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def make_backend(name: str, heads, block_size: int):
    from runner.attention import get_backend_cls

    num_heads, num_kv_heads, head_dim = heads
    backend = get_backend_cls(name)(CUDA, DTYPE)
    backend.configure(AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, block_size))
    return backend


def paged_case(ctx_lens, q_lens, block_size, heads, seed):
    """Random k/v for every position, the context already in a random-order
    paged cache full of garbage elsewhere, and this step's q/k/v."""
    tables, cache, qs, ks, vs = random_paged_kv(
        ctx_lens, q_lens, block_size, *heads, seed=seed, spare_blocks=5, dtype=DTYPE
    )
    inputs = make_inputs(ctx_lens, q_lens, block_size, tables, max(map(len, tables)) + 2, CUDA)
    q = torch.cat(qs).to(CUDA)
    k = torch.cat([ks[i][c:] for i, c in enumerate(ctx_lens)]).to(CUDA)
    v = torch.cat([vs[i][c:] for i, c in enumerate(ctx_lens)]).to(CUDA)
    return inputs, cache.to(CUDA), q, k, v, (qs, ks, vs, tables)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 64), (16, 2, 64)])
def test_flashinfer_matches_torch_backend(case, block_size, heads, monkeypatch):
    import runner.attention.flashinfer as fi_module

    monkeypatch.setattr(fi_module, "DECODE_TENSOR_CORES_FROM", 10**9 if case == "decode_cuda_cores" else 1)
    monkeypatch.setattr(fi_module, "TRITON_DECODE_MAX_BATCH", 8 if case == "decode_triton" else 0)
    ctx_lens, q_lens = CASES[case]
    inputs, cache, q, k, v, (qs, ks, vs, tables) = paged_case(ctx_lens, q_lens, block_size, heads, seed=list(CASES).index(case))
    layer = FakeLayer(*heads)

    fi = make_backend("flashinfer", heads, block_size)
    fi_cache = cache.clone()
    meta = fi.build_metadata(inputs)
    assert (meta.triton_decode is not None) == (case == "decode_triton")
    assert (meta.wrapper in fi.decode_wrappers.values()) == (case in ("decode", "decode_cuda_cores"))
    if meta.wrapper in fi.decode_wrappers.values():
        assert meta.wrapper.use_tensor_cores == (case == "decode")
    out = fi.forward(layer, q.clone(), k.clone(), v.clone(), fi_cache, meta)

    ref_backend = make_backend("torch", heads, block_size)
    ref_cache = cache.clone()
    ref_out = ref_backend.forward(layer, q, k, v, ref_cache, ref_backend.build_metadata(inputs))

    assert not out.isnan().any()
    # this step's k/v land in the same slots, bit for bit
    assert torch.equal(fi_cache, ref_cache)
    assert rel_err(out, ref_out) < 1e-2
    start = 0
    for i, (c, ql) in enumerate(zip(ctx_lens, q_lens)):
        dense = dense_attention(qs[i], ks[i], vs[i], c, layer.scale)
        assert rel_err(out[start : start + ql].cpu(), dense) < 1e-2, f"request {i}"
        start += ql


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16, 32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (16, 8, 128), (8, 8, 64), (28, 4, 128)])
def test_triton_paged_decode_long_contexts(num_splits, heads):
    """Split-KV with the merge in the kernel: contexts from 1 token to several
    thousand, every split count, one launch after another on the same tickets."""
    from runner.attention.triton_decode import DecodeScratch, paged_decode
    from runner.cuda_ops import store_kv

    num_heads, num_kv_heads, head_dim = heads
    seq_lens = [1, 33, 700, 4099]
    ctx_lens = [s - 1 for s in seq_lens]
    inputs, cache, q, k, v, (qs, ks, vs, _) = paged_case(ctx_lens, [1] * len(seq_lens), 16, heads, seed=3)
    store_kv(k, v, cache, inputs.slot_mapping)  # decode attends over all seq_len tokens, this step's too
    scratch = DecodeScratch(CUDA, 8, num_heads, num_kv_heads, head_dim)
    for _ in range(2):  # the tickets are back to zero after a launch
        out = torch.empty_like(q)
        paged_decode(q, cache, inputs.block_table, inputs.seq_lens, head_dim**-0.5, scratch, out, num_splits)
        assert torch.equal(scratch.tickets, torch.zeros_like(scratch.tickets))
        for i, c in enumerate(ctx_lens):
            dense = dense_attention(qs[i], ks[i], vs[i], c, head_dim**-0.5)
            assert rel_err(out[i : i + 1].cpu(), dense) < 1e-2, f"request {i} (seq_len {c + 1})"


@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 2, 64)])
def test_triton_decode_applies_rope_and_stores(heads, monkeypatch):
    """The model's path (positions given): the Triton decode rotates q and this
    step's k and writes k/v itself; the same cache and output as FlashInfer's
    path (the rope + store kernel, then FlashInfer's decode)."""
    import runner.attention.flashinfer as fi_module
    from models.layers.rotary import RotaryEmbedding

    num_heads, num_kv_heads, head_dim = heads
    ctx_lens, block_size = [3, 40, 0, 17, 300], 16
    inputs, cache, q, k, v, _ = paged_case(ctx_lens, [1] * len(ctx_lens), block_size, heads, seed=9)
    layer = FakeLayer(*heads)
    layer.rotary_emb = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(CUDA)
    positions = torch.tensor(ctx_lens, device=CUDA) + 7
    results = []
    for max_batch in (8, 0):
        monkeypatch.setattr(fi_module, "TRITON_DECODE_MAX_BATCH", max_batch)
        backend = make_backend("flashinfer", heads, block_size)
        meta = backend.build_metadata(inputs)
        assert (meta.triton_decode is not None) == (max_batch > 0)
        c = cache.clone()
        out = backend.forward(layer, q.clone(), k.clone(), v.clone(), c, meta, positions)
        results.append((out, c))
    (out, c), (ref_out, ref_c) = results
    assert rel_err(c, ref_c) < 1e-3 and torch.equal(c[:, 1], ref_c[:, 1])  # k rounds alike; v bit for bit
    assert rel_err(out, ref_out) < 1e-2


def test_flashinfer_rejects_float32():
    from runner.attention.flashinfer import FlashInferAttentionBackend
    from scheduler.config import ConfigError

    with pytest.raises(ConfigError, match="--dtype"):
        FlashInferAttentionBackend(CUDA, torch.float32)


# ---------------------------------------------------------------------------
# Triton ops vs the torch references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_and_activation_kernels(dtype):
    from runner import cuda_ops

    tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    g = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(37, 4096, device=CUDA, generator=g).to(dtype)
    r = torch.randn(37, 4096, device=CUDA, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(4096, device=CUDA, generator=g)).to(dtype)
    torch.testing.assert_close(cuda_ops.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6), **tol)
    want = ops.fused_add_rms_norm(x, r, w, 1e-5)
    x2, r2 = x.clone(), r.clone()
    got = cuda_ops.fused_add_rms_norm(x2, r2, w, 1e-5)
    assert got[0].data_ptr() == x2.data_ptr() and got[1].data_ptr() == r2.data_ptr()  # in place
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the add rounds as torch's
    torch.testing.assert_close(got[0], want[0], **tol)
    gate_up = torch.randn(37, 2 * 1000, device=CUDA, generator=g).to(dtype)
    torch.testing.assert_close(cuda_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), **tol)
    # q/k norm on a strided [tokens, heads, head_dim] view
    qkv = torch.randn(9, (4 + 2 + 2) * 128, device=CUDA, generator=g).to(dtype)
    q = qkv[:, : 4 * 128].view(9, 4, 128)
    wd = (1 + 0.1 * torch.randn(128, device=CUDA, generator=g)).to(dtype)
    torch.testing.assert_close(cuda_ops.rms_norm(q, wd, 1e-6), ops.rms_norm(q, wd, 1e-6), **tol)


def test_installed_ops_leave_cpu_tensors_to_torch():
    from runner.cuda_ops import install_cuda_ops

    install_cuda_ops()
    try:
        x = torch.randn(3, 64)
        torch.testing.assert_close(ops.OPS["rms_norm"](x, torch.ones(64), 1e-6), ops.rms_norm(x, torch.ones(64), 1e-6))
    finally:
        ops.reset_ops()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_and_kv_store_kernels(head_dim):
    from models.layers.rotary import RotaryEmbedding
    from runner import cuda_ops

    g = torch.Generator(device=CUDA).manual_seed(1)
    T, Hq, Hk = 23, 8, 2
    qkv = torch.randn(T, (Hq + 2 * Hk) * head_dim, device=CUDA, generator=g).to(DTYPE)
    q, k, v = qkv.split([Hq * head_dim, Hk * head_dim, Hk * head_dim], dim=-1)
    q, k, v = q.view(T, Hq, head_dim), k.view(T, Hk, head_dim), v.view(T, Hk, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 500000.0, None).to(CUDA)
    pos = torch.randint(0, 4096, (T,), device=CUDA, generator=g)
    want_q, want_k = ops.rotary_embedding(pos, q.clone(), k.clone(), rope.cos_sin_cache)
    got_q, got_k = cuda_ops.rotary_embedding(pos, q, k, rope.cos_sin_cache)  # in place on the views
    assert got_q.data_ptr() == q.data_ptr()
    assert rel_err(got_q, want_q) < 1e-2 and rel_err(got_k, want_k) < 1e-2

    block_size, num_blocks = 16, 8
    cache = torch.randn(num_blocks, 2, block_size, Hk, head_dim, device=CUDA, generator=g).to(DTYPE)
    slots = torch.randperm(num_blocks * block_size, device=CUDA, generator=g)[:T]
    want = cache.clone()
    want[slots // block_size, 0, slots % block_size] = k
    want[slots // block_size, 1, slots % block_size] = v
    cuda_ops.store_kv(k, v, cache, slots)
    assert torch.equal(cache, want)

    # rope + store in one launch: the same cache bits and the same rotated q as the two kernels
    q0, k0, v0 = q.clone(), k.clone(), v.clone()  # q and k above are rotated: start again from them
    cache2, want2 = cache.clone(), cache.clone()
    want_q2, want_k2 = cuda_ops.rotary_embedding(pos, q0.clone(), k0.clone(), rope.cos_sin_cache)
    cuda_ops.store_kv(want_k2, v0, want2, slots)
    got_q2 = q0.clone()
    cuda_ops.rope_and_store_kv(pos, got_q2, k0, v0, rope.cos_sin_cache, cache2, slots)
    assert torch.equal(got_q2, want_q2)
    assert torch.equal(cache2, want2)
    assert torch.equal(k0, k)  # k itself is not written


@pytest.mark.parametrize("n, k, bias", [(6144, 4096, False), (1000, 1024, True), (4096, 14336, False)])
def test_gemv_matches_linear(n, k, bias):
    from runner import cuda_ops

    g = torch.Generator(device=CUDA).manual_seed(2)
    w = (torch.randn(n, k, device=CUDA, generator=g) * 0.02).to(DTYPE)
    b = torch.randn(n, device=CUDA, generator=g).to(DTYPE) if bias else None
    x = torch.randn(1, k, device=CUDA, generator=g).to(DTYPE)
    want = torch.nn.functional.linear(x, w, b)
    got = cuda_ops.linear(x, w, b)  # one row, a small weight: the Triton GEMV
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < 1e-2
    x2 = torch.randn(3, k, device=CUDA, generator=g).to(DTYPE)  # more rows: cuBLAS
    torch.testing.assert_close(cuda_ops.linear(x2, w, b), torch.nn.functional.linear(x2, w, b))


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("n, k, bias", [(6144, 4096, False), (1000, 1024, True), (28672, 4096, False)])
def test_norm_gemv_matches_ops(n, k, bias, has_residual):
    """A sublayer's entry at batch 1 (add + RMSNorm + matmul) in one GEMV
    against the unfused torch ops; more rows take the unfused kernels."""
    from runner import cuda_ops

    g = torch.Generator(device=CUDA).manual_seed(4)
    w = (torch.randn(n, k, device=CUDA, generator=g) * 0.02).to(DTYPE)
    b = torch.randn(n, device=CUDA, generator=g).to(DTYPE) if bias else None
    x = torch.randn(1, k, device=CUDA, generator=g).to(DTYPE)
    r = torch.randn(1, k, device=CUDA, generator=g).to(DTYPE) if has_residual else None
    nw = (1 + 0.1 * torch.randn(k, device=CUDA, generator=g)).to(DTYPE)
    want, want_r = ops.add_rms_norm_linear(x.clone(), None if r is None else r.clone(), nw, 1e-5, w, b)
    got, got_r = cuda_ops.add_rms_norm_linear(x, r, nw, 1e-5, w, b)
    assert got.shape == want.shape == (1, n) and got.dtype == DTYPE
    assert rel_err(got, want) < 1e-2
    assert torch.equal(got_r, want_r)  # the residual add rounds as torch's
    x3 = torch.randn(3, k, device=CUDA, generator=g).to(DTYPE)
    r3 = torch.randn(3, k, device=CUDA, generator=g).to(DTYPE)
    want3, _ = ops.add_rms_norm_linear(x3.clone(), r3.clone(), nw, 1e-5, w, b)
    got3, _ = cuda_ops.add_rms_norm_linear(x3.clone(), r3.clone(), nw, 1e-5, w, b)
    assert rel_err(got3, want3) < 1e-2
