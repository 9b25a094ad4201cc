"""The torch attention backend against dense attention, the persistent batch,
and ModelRunner.execute on a tiny stand-in model against a dense forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.forward_context import get_forward_context
from runner.attention import AttentionInputs, default_backend_name, get_backend_cls
from runner.attention.torch_backend import TorchAttentionBackend
from runner.input_batch import InputBatch
from runner.model_runner import ModelRunner
from scheduler.types import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------
# Attention backend vs a dense reference
# ---------------------------------------------------------------------------


class FakeLayer:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.layer_idx = 0


def make_inputs(ctx_lens, q_lens, block_size, block_tables, max_blocks, device=CPU) -> AttentionInputs:
    n = len(q_lens)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    bt = np.zeros((n, max_blocks), dtype=np.int32)
    for i, blocks in enumerate(block_tables):
        bt[i, : len(blocks)] = blocks
    slots = []
    for i in range(n):
        for pos in range(ctx_lens[i], seq_lens[i]):
            slots.append(block_tables[i][pos // block_size] * block_size + pos % block_size)
    t = torch.from_numpy
    return AttentionInputs(
        num_reqs=n,
        num_tokens=int(qsl[-1]),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=t(qsl),
        seq_lens_cpu=t(np.array(seq_lens, dtype=np.int32)),
        num_computed_tokens_cpu=t(np.array(ctx_lens, dtype=np.int32)),
        block_table_cpu=t(bt),
        query_start_loc=t(qsl).to(device),
        seq_lens=t(np.array(seq_lens, dtype=np.int32)).to(device),
        block_table=t(bt).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )


def dense_attention(q, k, v, ctx, scale):
    """q: [q_len, Hq, D], k/v: [seq_len, Hkv, D], float64 reference."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=1).double()
    v = v.repeat_interleave(rep, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(seq_len)[None, :] <= (torch.arange(q_len)[:, None] + ctx)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_paged_kv(
    ctx_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim, *, seed, spare_blocks, dtype=torch.float32
):
    """Random k/v for every position of each request, its context already
    in a paged cache of random block order and garbage everywhere else (so a
    wrong gather shows up), and this step's q. Returns (block_tables,
    kv_cache, qs, ks, vs), all on the CPU; ks[i]/vs[i]: [ctx + q_len, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_tables, start = [], 0
    for nb in blocks_needed:
        block_tables.append(perm[start : start + nb])
        start += nb
    kv_cache = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    ks = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    vs = [torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype) for s in seq_lens]
    qs = [torch.randn(q, num_heads, head_dim, generator=g).to(dtype) for q in q_lens]
    for i, c in enumerate(ctx_lens):
        for pos in range(c):
            b = block_tables[i][pos // block_size]
            kv_cache[b, 0, pos % block_size] = ks[i][pos]
            kv_cache[b, 1, pos % block_size] = vs[i][pos]
    return block_tables, kv_cache, qs, ks, vs


def run_backend_case(
    ctx_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim, seed=0, gather_tokens=32768, device=CPU
):
    block_tables, kv_cache, qs, ks, vs = random_paged_kv(
        ctx_lens, q_lens, block_size, num_heads, num_kv_heads, head_dim, seed=seed, spare_blocks=3
    )
    max_blocks = max(map(len, block_tables)) + 2
    inputs = make_inputs(ctx_lens, q_lens, block_size, block_tables, max_blocks, device)
    backend = TorchAttentionBackend(device, torch.float32, decode_gather_tokens=gather_tokens)
    meta = backend.build_metadata(inputs)
    layer = FakeLayer(num_heads, num_kv_heads, head_dim)
    q = torch.cat(qs)
    k = torch.cat([ks[i][c:] for i, c in enumerate(ctx_lens)])
    v = torch.cat([vs[i][c:] for i, c in enumerate(ctx_lens)])
    dev_cache = kv_cache.to(device)
    out = backend.forward(layer, q.to(device), k.to(device), v.to(device), dev_cache, meta).cpu()
    kv_cache = dev_cache.cpu()

    start = 0
    for i, (c, ql) in enumerate(zip(ctx_lens, q_lens)):
        ref = dense_attention(qs[i], ks[i], vs[i], c, layer.scale)
        torch.testing.assert_close(out[start : start + ql].double(), ref, atol=2e-5, rtol=2e-5)
        start += ql
        # this step's k/v landed in the right slots
        for pos in range(c, c + ql):
            b = block_tables[i][pos // block_size]
            assert torch.equal(kv_cache[b, 0, pos % block_size], ks[i][pos])
            assert torch.equal(kv_cache[b, 1, pos % block_size], vs[i][pos])


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4, 64), (8, 2, 128), (6, 1, 64)])
def test_backend_mixed_batch(block_size, heads):
    # fresh prefill, decode, chunked prefill on top of context, another decode
    run_backend_case([0, 9, 5, 17], [7, 1, 6, 1], block_size, *heads)


@pytest.mark.parametrize("block_size", [2, 8])
def test_backend_prefill_only(block_size):
    run_backend_case([0, 0, 0], [5, 1, 13], block_size, 8, 4, 64)


@pytest.mark.parametrize("block_size", [4, 16])
def test_backend_decode_only_groups(block_size):
    ctx = [3, 40, 0, 17, 9, 33, 1]
    # a tiny gather budget forces several decode groups
    run_backend_case(ctx, [1] * len(ctx), block_size, 8, 2, 128, gather_tokens=64)
    run_backend_case(ctx, [1] * len(ctx), block_size, 8, 2, 128)


def test_backend_chunked_prefill_chunks():
    # the same request's chunks one after another agree with one dense pass
    run_backend_case([4, 12], [8, 3], 4, 4, 2, 64, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16])
def test_backend_on_cuda(block_size):
    cuda = torch.device("cuda")
    run_backend_case([0, 9, 5, 17], [7, 1, 6, 1], block_size, 8, 2, 128, device=cuda)
    run_backend_case([3, 40, 0, 17], [1, 1, 1, 1], block_size, 4, 4, 64, device=cuda, gather_tokens=64)


def test_backend_registry():
    assert get_backend_cls("torch") is TorchAttentionBackend
    assert default_backend_name(CPU) == "torch"
    with pytest.raises(ValueError, match="attention-backend"):
        get_backend_cls("nope")


# ---------------------------------------------------------------------------
# Persistent batch
# ---------------------------------------------------------------------------


def new_req(req_id, prompt, output=(), blocks=(), computed=0, **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        sampling_params=SamplingParams(**params),
        block_ids=list(blocks),
        num_computed_tokens=computed,
    )


def test_batch_add_remove_condense():
    batch = InputBatch(max_num_seqs=4, max_model_len=32, max_blocks_per_req=8, device=CPU)
    batch.add_request(new_req("a", [1, 2, 3], blocks=[5], temperature=0.5))
    batch.add_request(new_req("b", [4, 5], [6], blocks=[7, 8], top_k=3))
    batch.add_request(new_req("c", [9], blocks=[2], seed=11))
    batch.add_request(new_req("d", [10, 11], blocks=[3], top_p=0.5))
    assert [batch.row_of(r) for r in "abcd"] == [0, 1, 2, 3]

    batch.remove_request("a")
    batch.remove_request("c")
    assert batch.remove_request("zzz") is None  # unknown ids are ignored
    batch.condense()
    # d (row 3) moves into the hole at row 0; b stays at row 1
    assert batch.row_of("d") == 0 and batch.row_of("b") == 1
    assert batch.req_ids == ["d", "b", None, None]
    assert batch.all_token_ids(0) == [10, 11] and batch.block_table.block_ids(0) == [3]
    assert batch.sampling.top_p[0] == pytest.approx(0.5) and batch.sampling.top_k[0] == 0
    assert batch.all_token_ids(1) == [4, 5, 6] and batch.output_token_ids(1) == [6]
    assert batch.sampling.top_k[1] == 3
    # vacated rows hold defaults
    assert batch.sampling.seed[2] is None and batch.sampling.temperature[3] == 1.0

    # a new request takes the lowest free row; in-place updates
    row = batch.add_request(new_req("e", [1, 1, 1, 1, 1], blocks=[9], computed=0, logprobs=2))
    assert row == 2
    batch.update_request("e", [10], 4)
    batch.append_token(row, 42)
    assert batch.block_table.block_ids(row) == [9, 10]
    assert batch.num_computed_tokens[row] == 4
    assert batch.output_token_ids(row) == [42]
    assert batch.sampling.num_logprobs[row] == 2

    # removing several then condensing keeps the rows dense and right
    batch.add_request(new_req("f", [7], blocks=[1]))
    batch.remove_request("d")
    batch.remove_request("b")
    batch.condense()
    assert sorted(batch.req_id_to_row.values()) == [0, 1]
    assert batch.all_token_ids(batch.row_of("e")) == [1, 1, 1, 1, 1, 42]
    assert batch.all_token_ids(batch.row_of("f")) == [7]
    with pytest.raises(ValueError, match="already"):
        batch.add_request(new_req("e", [1]))


def test_batch_rejects_too_long():
    batch = InputBatch(max_num_seqs=2, max_model_len=4, max_blocks_per_req=1, device=CPU)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add_request(new_req("a", [1, 2, 3, 4, 5]))


# ---------------------------------------------------------------------------
# ModelRunner.execute on a stand-in model
# ---------------------------------------------------------------------------


class ToyAttention(nn.Module):
    def __init__(self, hidden, num_heads, num_kv_heads, head_dim, layer_idx):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim)
        self.o = nn.Linear(num_heads * head_dim, hidden)
        self.dense = False

    def forward(self, x):
        n = x.shape[0]
        q, k, v = self.qkv(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1
        )
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.dense:  # one sequence, no cache
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        else:
            ctx = get_forward_context()
            out = ctx.backend.forward(self, q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata)
        return self.o(out.reshape(n, -1))


class ToyModel(nn.Module):
    """embedding + learned positions + 2 attention layers + lm head."""

    def __init__(self, vocab=50, hidden=32, num_heads=4, num_kv_heads=2, head_dim=16, max_len=64):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.layers = nn.ModuleList(ToyAttention(hidden, num_heads, num_kv_heads, head_dim, i) for i in range(2))
        self.head = nn.Linear(hidden, vocab)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def forward(self, input_ids, positions):
        h = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            h = h + layer(h)
        return h

    def compute_logits(self, hidden):
        return self.head(hidden).float()

    @torch.no_grad()
    def dense_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        for layer in self.layers:
            layer.dense = True
        try:
            ids = torch.tensor(token_ids)
            h = self.forward(ids, torch.arange(len(ids)))
            return torch.log_softmax(self.compute_logits(h), -1)
        finally:
            for layer in self.layers:
                layer.dense = False


def make_runner(model, block_size=4, num_blocks=64, max_num_seqs=4, max_model_len=64, max_tokens=32):
    kv = [torch.zeros(num_blocks, 2, block_size, model.num_kv_heads, model.head_dim) for _ in model.layers]
    return ModelRunner(
        model,
        kv,
        TorchAttentionBackend(CPU, torch.float32),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_tokens,
        device=CPU,
        eos_token_ids=(0,),
    )


def sched(new=(), cached=(), num_scheduled=None, finished=()) -> SchedulerOutput:
    cached = list(cached)
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=CachedRequestData(
            [c[0] for c in cached], [c[1] for c in cached], [c[2] for c in cached]
        ),
        num_scheduled_tokens=dict(num_scheduled),
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        finished_req_ids=set(finished),
    )


def test_runner_execute_matches_dense_forward():
    model = ToyModel()
    runner = make_runner(model)
    pa = [3, 14, 15, 9, 2, 6, 5]  # 7 tokens: chunked 5 + 2
    pb = [8, 1, 7]
    tokens = {"a": list(pa), "b": list(pb)}
    greedy = dict(temperature=0.0, logprobs=3)

    def check(out, expect_sampled):
        assert set(out.req_ids) >= set(expect_sampled)
        for i, rid in enumerate(out.req_ids):
            if rid not in expect_sampled:
                assert out.sampled_token_ids[i] == []
                continue
            ref = model.dense_logprobs(tokens[rid])[-1]
            (tok,) = out.sampled_token_ids[i]
            assert tok == int(ref.argmax())
            lp = out.logprobs[i]
            assert lp.token_ids[0] == tok and lp.rank == 1
            assert lp.logprobs[0] == pytest.approx(float(ref[tok]), abs=1e-4)
            assert lp.token_ids[1:] == ref.topk(3).indices.tolist()
            tokens[rid].append(tok)

    # step 1: a's first chunk (5 of 7), b whole (3) -> only b samples
    out = runner.execute(
        sched(
            new=[new_req("a", pa, blocks=[10, 3], **greedy), new_req("b", pb, blocks=[7], **greedy)],
            num_scheduled={"a": 5, "b": 3},
        )
    )
    check(out, {"b"})
    # step 2: a's last 2 prompt tokens (needs a third block), b decodes
    out = runner.execute(sched(cached=[("a", [20], 5), ("b", [], 3)], num_scheduled={"a": 2, "b": 1}))
    check(out, {"a", "b"})
    # step 3: b finished; c arrives with a prompt bigger than one block; a decodes
    pc = [4, 4, 5, 6, 11, 12]
    tokens["c"] = list(pc)
    out = runner.execute(
        sched(
            new=[new_req("c", pc, blocks=[1, 2], **greedy)],
            cached=[("a", [], 7)],
            num_scheduled={"a": 1, "c": 6},
            finished={"b"},
        )
    )
    check(out, {"a", "c"})
    assert "b" not in runner.batch
    # step 4: both decode; a resumed request (preempted c) restarts from scratch
    out = runner.execute(
        sched(cached=[("a", [], 8)], num_scheduled={"a": 1}, finished={"c"})
    )
    check(out, {"a"})
    out = runner.execute(
        sched(
            new=[new_req("c", pc, tokens["c"][len(pc):], blocks=[30, 31], **greedy)],
            cached=[("a", [], 9)],
            num_scheduled={"c": 7, "a": 1},
        )
    )
    check(out, {"a", "c"})


def test_runner_prompt_logprobs_across_chunks():
    model = ToyModel()
    runner = make_runner(model, max_tokens=8)
    prompt = [5, 9, 13, 2, 7, 31, 8, 8, 1, 40, 22]  # 11 tokens: chunks 4 + 4 + 3
    req = new_req("p", prompt, blocks=[0, 1, 2], temperature=0.0, prompt_logprobs=2)
    out = runner.execute(sched(new=[req], num_scheduled={"p": 4}))
    assert out.prompt_logprobs is None and out.sampled_token_ids == [[]]
    out = runner.execute(sched(cached=[("p", [], 4)], num_scheduled={"p": 4}))
    assert out.prompt_logprobs is None
    out = runner.execute(sched(cached=[("p", [], 8)], num_scheduled={"p": 3}))
    plp = out.prompt_logprobs["p"]
    ref = model.dense_logprobs(prompt)
    assert len(plp) == len(prompt) - 1
    for pos, lp in enumerate(plp, start=1):
        assert lp.token_ids[0] == prompt[pos]
        assert lp.logprobs[0] == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert lp.token_ids[1:] == ref[pos - 1].topk(2).indices.tolist()
        assert lp.rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1


def test_sampling_metadata_from_batch_rows():
    from runner.sampler import SamplingMetadata

    batch = InputBatch(max_num_seqs=3, max_model_len=16, max_blocks_per_req=4, device=CPU)
    batch.add_request(new_req("a", [1, 2, 3], [4], temperature=0.3, repetition_penalty=1.2))
    batch.add_request(new_req("b", [5], [6, 7, 8], top_k=7, min_tokens=5, stop_token_ids=[9]))
    meta = SamplingMetadata.from_batch(batch, np.array([1, 0]))
    assert meta.num_output_tokens.tolist() == [3, 1]
    ids = meta.token_ids()
    assert ids[0, :4].tolist() == [5, 6, 7, 8] and ids[1, :4].tolist() == [1, 2, 3, 4]
    assert meta.params.top_k.tolist() == [7, 0]
    assert meta.params.repetition_penalty.tolist() == pytest.approx([1.0, 1.2])
    assert meta.params.min_tokens_stop_ids[0] == (9,)


def test_prepare_inputs_block_table_has_only_the_columns_the_step_reads():
    # max_model_len 64, block_size 4 -> 16 columns per row; seq_lens [6, 3] read 2
    runner = make_runner(ToyModel())
    runner.execute(
        sched(
            new=[new_req("a", [3, 1, 4, 1, 5, 9], blocks=[7, 2]), new_req("b", [2, 6, 5], blocks=[11])],
            num_scheduled={"b": 3, "a": 6},
        )
    )
    runner._update_batch(sched(cached=[("a", [], 6), ("b", [], 3)], num_scheduled={"a": 1, "b": 1}))
    step = runner._prepare_inputs({"a": 1, "b": 1})  # decode: seq_lens [7, 4]
    assert step.attn.block_table_cpu.tolist() == [[7, 2], [11, 0]]
    assert step.attn.block_table.shape == (2, 2) and step.attn.block_table.is_contiguous()


def test_batch_moved_row_keeps_zeros_past_its_blocks():
    batch = InputBatch(max_num_seqs=3, max_model_len=32, max_blocks_per_req=8, device=CPU)
    batch.add_request(new_req("a", [1], blocks=[4, 5, 6, 7]))
    batch.add_request(new_req("b", [2], blocks=[8]))
    batch.remove_request("a")
    batch.condense()  # b moves into a's row, which held 4 blocks
    assert batch.block_table.table[0].tolist() == [8, 0, 0, 0, 0, 0, 0, 0]
    batch.update_requests(["b"], [[9, 10]], [1])
    assert batch.block_table.block_ids(0) == [8, 9, 10]


def test_batch_sampling_of_is_reused_until_a_row_changes():
    batch = InputBatch(max_num_seqs=3, max_model_len=16, max_blocks_per_req=4, device=CPU)
    batch.add_request(new_req("a", [1], temperature=0.3))
    batch.add_request(new_req("b", [2], temperature=0.7))
    rows = np.array([1, 0])
    first = batch.sampling_of(rows)
    batch.append_tokens(rows, np.array([5, 6]))  # tokens do not touch the columns
    assert batch.sampling_of(np.array([1, 0])) is first
    assert batch.sampling_of(np.array([0, 1])).temperature.tolist() == pytest.approx([0.3, 0.7])
    batch.remove_request("a")
    batch.add_request(new_req("c", [3], temperature=0.9))  # takes row 0
    assert batch.sampling_of(rows).temperature.tolist() == pytest.approx([0.7, 0.9])
    assert batch.all_token_ids(1) == [2, 5]
