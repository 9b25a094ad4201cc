"""KV block manager: direct unit tests of hashing / LRU eviction, and a
hypothesis state machine driving the real Scheduler with the fake runner
under a tiny KV cache, checking the block invariants after every action."""

from __future__ import annotations

import collections

import hypothesis.strategies as st
from fake_runner import Collected, FakeRunner, make_request, reference_generate, step_scheduler
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.block_manager import ROOT_HASH, BlockManager, FreeBlockQueue
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from scheduler.types import FinishReason, SamplingParams

BS = 4


def new_req(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=100))


def admit(bm: BlockManager, req: Request) -> tuple[list[int], int]:
    """Admit and 'compute' the whole prompt, as the scheduler + runner would."""
    hits, num_hit = bm.get_computed_blocks(req)
    assert bm.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req, req.num_computed_tokens)
    return hits, num_hit


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 6), ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=60))
def test_free_block_queue_matches_an_ordered_dict(num_blocks, ops):
    queue, model = FreeBlockQueue(num_blocks), collections.OrderedDict.fromkeys(range(num_blocks))
    for op, pick in ops:
        free = list(model)
        taken = [b for b in range(num_blocks) if b not in model]
        if op == 0 and free:
            assert queue.popleft() == model.popitem(last=False)[0]
        elif op == 1 and free:
            b = free[pick % len(free)]
            queue.remove(b)
            del model[b]
        elif op == 2 and taken:
            b = taken[pick % len(taken)]
            queue.append(b)
            model[b] = None
        elif op == 3 and taken:
            b = taken[pick % len(taken)]
            queue.appendleft(b)
            model[b] = None
            model.move_to_end(b, last=False)
        assert list(queue) == list(model) and len(queue) == len(model)
        assert all((b in queue) == (b in model) for b in range(num_blocks))


def test_chained_hash_shares_only_the_common_prefix():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = new_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    admit(bm, a)
    assert len(bm.hash_to_block) == 3  # three full blocks, the 13th token is not cached
    # same block 0, different block 1, same block 2: the chain stops at block 1
    b = new_req("b", [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13])
    hits, num_hit = admit(bm, b)
    assert hits == a.block_ids[:1] and num_hit == 4
    assert b.block_ids[0] == a.block_ids[0] and bm.ref_cnt[a.block_ids[0]] == 2
    assert set(b.block_ids[1:]).isdisjoint(a.block_ids)


def test_hit_is_capped_so_the_last_token_is_computed():
    # block_size=4: an 8-token prompt whose two blocks are cached reports one block
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, new_req("a", list(range(9))))  # caches blocks [0..3], [4..7]
    assert bm.get_computed_blocks(new_req("b", list(range(8))))[1] == 4
    assert bm.get_computed_blocks(new_req("c", list(range(9))))[1] == 8
    assert bm.get_computed_blocks(new_req("d", list(range(4))))[1] == 0
    assert bm.get_computed_blocks(new_req("e", list(range(5))))[1] == 4


def test_hash_collision_with_different_tokens_is_a_miss():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = new_req("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    b = new_req("b", [9, 9, 9, 9, 5])
    bm._extend_block_hashes(b, 1)
    # forge a collision: b's first-block hash points at a's block
    bm.hash_to_block[b.block_hashes[0]] = a.block_ids[0]
    assert bm.get_computed_blocks(b) == ([], 0)


def test_hash_collision_with_different_parent_is_a_miss():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = new_req("a", [1, 1, 1, 1, 7, 7, 7, 7, 0])
    admit(bm, a)
    b = new_req("b", [2, 2, 2, 2, 7, 7, 7, 7, 0])  # same second block, other parent
    admit(bm, b)
    c = new_req("c", [1, 1, 1, 1, 7, 7, 7, 7, 0])
    bm._extend_block_hashes(c, 2)
    bm.hash_to_block[c.block_hashes[1]] = b.block_ids[1]  # same tokens, wrong prefix
    hits, _ = bm.get_computed_blocks(c)
    assert hits == a.block_ids[:1]


def test_freed_blocks_keep_their_hash_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = new_req("a", [1, 2, 3, 4, 0])  # 1 full block + 1 partial
    admit(bm, a)
    a_full = a.block_ids[0]
    bm.free(a)
    b = new_req("b", [5, 6, 7, 8, 0])
    admit(bm, b)
    b_full, b_partial = b.block_ids
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert len(bm.hash_to_block) == 2  # both full blocks still cached
    # unhashed blocks (b's partial one, the never used one) go out first,
    # then the least recently freed cached one: a's
    c = new_req("c", list(range(100, 111)))  # needs 3 fresh blocks
    hits, _ = bm.get_computed_blocks(c)
    assert hits == []
    new = bm.allocate_slots(c, 11, hits)
    assert new[0] == b_partial and new[2] == a_full and b_full not in new
    assert bm.block_hash[a_full] is None  # evicted: hash entry gone
    assert len(bm.hash_to_block) == 1
    # b's block survives and is still found
    assert bm.get_computed_blocks(new_req("d", [5, 6, 7, 8, 1]))[0] == [b_full]


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = new_req("a", [1, 2, 3, 4, 0])
    admit(bm, a)
    cached = a.block_ids[0]
    bm.free(a)
    b = new_req("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    hits, num_hit = bm.get_computed_blocks(b)
    assert hits == [cached] and num_hit == 4
    assert bm.allocate_slots(b, 5, hits) is not None
    assert cached not in bm.free_queue and bm.ref_cnt[cached] == 1
    assert b.block_ids[0] == cached and len(b.block_ids) == 3
    assert bm.num_free_blocks == 0


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = new_req("a", list(range(12)))
    assert bm.allocate_slots(a, 12, []) is None
    assert a.block_ids == [] and bm.num_free_blocks == 2
    # a hit on a free cached block counts against the free pool too
    x = new_req("x", [1, 2, 3, 4, 0])
    admit(bm, x)
    bm.free(x)
    y = new_req("y", [1, 2, 3, 4] + list(range(9)))  # 1 hit + needs 3 more blocks
    hits, _ = bm.get_computed_blocks(y)
    assert len(hits) == 1
    assert bm.allocate_slots(y, 9, hits) is None
    assert bm.num_free_blocks == 2 and bm.ref_cnt[hits[0]] == 0


def test_counters_are_in_tokens():
    bm = BlockManager(num_blocks=16, block_size=BS)
    admit(bm, new_req("a", list(range(10))))
    admit(bm, new_req("b", list(range(10))))
    assert bm.prefix_cache_queries_total == 20
    assert bm.prefix_cache_hits_total == 8


def test_duplicate_prefix_computed_twice_registers_one_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = new_req("a", [1, 2, 3, 4, 5]), new_req("b", [1, 2, 3, 4, 5])
    for r in (a, b):  # both admitted before either is computed
        assert bm.allocate_slots(r, 5, bm.get_computed_blocks(r)[0]) is not None
    for r in (a, b):
        r.num_computed_tokens = 5
        bm.cache_full_blocks(r, 5)
    assert a.block_ids[0] != b.block_ids[0]
    assert list(bm.hash_to_block.values()) == [a.block_ids[0]]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_disabled_prefix_caching_never_hashes():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_caching=False)
    for name in "ab":
        r = new_req(name, list(range(9)))
        hits, n = admit(bm, r)
        assert hits == [] and n == 0
    assert bm.hash_to_block == {} and bm.prefix_cache_queries_total == 0
    assert bm.usage == 6 / 8


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = new_req("a", list(range(9)))
    admit(bm, a)
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {}
    assert bm.get_computed_blocks(new_req("b", list(range(9)))) == ([], 0)
    bm.free(a)
    assert bm.num_free_blocks == 8


# ----------------------------------------------------------------------------
# Property test: the real scheduler, the fake runner, a tiny KV cache.
# ----------------------------------------------------------------------------

VOCAB = 12
EOS = 3
PREFIXES = [[1, 2, 4, 5, 6, 7, 8, 9], [1, 2, 4, 5, 0, 0, 0, 0], [9, 8, 7, 6, 5, 4, 2, 1], [11]]


def check_block_invariants(sched: Scheduler) -> None:
    bm = sched.block_manager
    holders: collections.Counter[int] = collections.Counter()
    for req in sched.requests.values():
        if req.status == RequestStatus.RUNNING:
            holders.update(req.block_ids)
            assert len(req.block_ids) * bm.block_size >= req.num_computed_tokens
        else:
            assert req.block_ids == [], f"{req} holds blocks while not running"
    for b in range(bm.num_blocks):
        # free xor referenced, and referenced exactly by the live requests holding it
        assert (b in bm.free_queue) == (bm.ref_cnt[b] == 0), b
        assert bm.ref_cnt[b] == holders[b], b
        if bm.block_hash[b] is not None:
            assert bm.hash_to_block[bm.block_hash[b]] == b
    for h, b in bm.hash_to_block.items():
        parent, token_ids = bm.block_key[b]
        assert bm.block_hash[b] == h == hash((parent, token_ids)) and len(token_ids) == bm.block_size
    # the cached blocks a running request maps hold that request's tokens
    for req in sched.requests.values():
        for i in range(req.num_hashed_blocks):
            b = req.block_ids[i]
            if bm.block_hash[b] is not None:
                parent, token_ids = bm.block_key[b]
                assert list(token_ids) == req.all_token_ids[i * bm.block_size : (i + 1) * bm.block_size]
                assert bm.block_hash[b] == req.block_hashes[i]
                assert parent == (req.block_hashes[i - 1] if i else ROOT_HASH)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(5, 14),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(5, 16),
        caching=st.booleans(),
    )
    def setup(self, block_size, num_blocks, max_num_seqs, budget, caching):
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=24,
            block_size=block_size,
            enable_prefix_caching=caching,
        )
        self.sched = Scheduler(self.config, num_blocks)
        self.runner = FakeRunner(num_blocks, block_size, vocab_size=VOCAB)
        self.prompts: dict[str, list[int]] = {}
        self.collected = Collected()
        self.next_id = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=6),
        max_tokens=st.integers(1, 10),
        use_eos=st.booleans(),
    )
    def add(self, prefix, suffix, max_tokens, use_eos):
        prompt = (prefix + suffix)[: self.sched.max_model_len]
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.sched.add_request(make_request(req_id, prompt, EOS if use_eos else None, max_tokens=max_tokens))
        self.prompts[req_id] = prompt

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            so, outputs = step_scheduler(self.sched, self.runner)
            assert so.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
            assert len(self.sched.running) <= self.config.max_num_seqs
            self.collected.add(outputs)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort_live(self, data):
        req_id = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.abort_requests([req_id])
        assert req_id not in self.sched.requests

    @rule()
    def abort_unknown(self):
        self.sched.abort_requests(["no-such-request", "r0"])  # r0 may be long gone

    @rule()
    def reset_prefix_cache(self):
        self.sched.reset_prefix_cache()

    @invariant()
    def blocks_consistent(self):
        if hasattr(self, "sched"):
            check_block_invariants(self.sched)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            self.collected.add(step_scheduler(self.sched, self.runner)[1])
            check_block_invariants(self.sched)
        assert not self.sched.has_unfinished_requests()
        bm = self.sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0  # nothing leaked
        assert not any(bm.ref_cnt)
        # every request finished exactly once, with the tokens it would get alone
        assert set(self.collected.finish) == set(self.prompts)
        for req_id, prompt in self.prompts.items():
            tokens = self.collected.tokens.get(req_id, [])
            assert tokens == reference_generate(prompt, len(tokens), VOCAB)
            reason = self.collected.finish[req_id]
            if reason == FinishReason.STOP:
                assert tokens[-1] == EOS


SchedulerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestSchedulerInvariants = SchedulerMachine.TestCase
