"""The KV block manager: paged blocks, ref counts, prefix cache, LRU eviction.

The KV cache is `num_blocks` blocks of `block_size` token slots. A request
owns the list `request.block_ids`; token position p lives in block
`block_ids[p // block_size]`, slot `p % block_size`.

Prefix caching. Once a block is FULL and its tokens are computed, it is
registered under a chained hash

    h_0 = hash((ROOT_HASH, tuple(tokens[0:16])))
    h_i = hash((h_{i-1}, tuple(tokens[16*i:16*(i+1)])))       (block_size=16)

so h_i names the whole prefix up to the end of block i. A lookup walks the
request's full blocks from the start and stops at the first miss. A hit is
verified against what the block stores (its parent hash and its token ids):
a hash collision whose stored tokens differ is a miss, never wrong KV.

Free blocks sit in one LRU queue (oldest first). A freed block keeps its hash
(its KV stays reusable) until it is taken as a fresh block, which evicts the
hash entry. A hit on a free cached block takes it back out of the queue.
Blocks without a hash are freed to the front of the queue (reused first),
and a request frees its blocks tail first, so prompt heads, the most
shareable part, are evicted last.

Invariant: a block is in the free queue iff its ref_cnt is 0.
`hash_to_block` maps each hash to exactly one block whose `block_hash` is it.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler.request import Request

ROOT_HASH = 0x5E4A1  # parent hash of a request's first block


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set iff registered in hash_to_block
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockManager:
    """Allocates KV blocks to requests. Every call costs O(blocks touched).

    Counters (for SchedulerStats): `prefix_cache_queries_total` and
    `prefix_cache_hits_total`, in tokens, counted on each admission.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> None, least recently freed first. OrderedDict gives O(1)
        # append, pop-oldest and removal from the middle (cache hit).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    # ------------------------------------------------------------------ gauges

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): all can be handed out."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live request, 0..1."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    # ------------------------------------------------------------------ hashing

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Make request.block_hashes cover its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_blocks):
            parent = hash((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            hashes.append(parent)

    # ------------------------------------------------------------------ lookup

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of `request`, as (block_ids, num_tokens).

        At least the last token is always left to compute, so that the step
        produces logits: the hit is capped at (num_tokens - 1) // block_size
        full blocks. E.g. block_size=16: a 32-token prompt whose two blocks
        are both cached reports ([b0], 16), and the second block is
        recomputed; a 33-token prompt reports ([b0, b1], 32).
        Pure lookup: nothing changes until `allocate_slots` takes the blocks.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        self._extend_block_hashes(request, max_blocks)
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            h = hashes[i]
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                break  # hash collision: not our prefix
            hits.append(block_id)
            parent = h
        return hits, len(hits) * bs

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
    ) -> list[int] | None:
        """Give `request` blocks for its next `num_new_tokens` tokens.

        On admission pass the blocks from `get_computed_blocks` (even an
        empty list: that counts the prefix-cache query); they are taken with a
        ref count and appended to `request.block_ids` first, and the new
        tokens start after them. `request.num_computed_tokens` is the count
        before those cached blocks (0 for a waiting request).

        Returns the ids of the freshly allocated blocks (often []), or None,
        changing nothing, when there are not enough free blocks.
        """
        bs = self.block_size
        block_ids = request.block_ids
        num_hit = len(new_computed_blocks) if new_computed_blocks else 0
        num_tokens = request.num_computed_tokens + num_hit * bs + num_new_tokens
        num_needed = -(-num_tokens // bs) - len(block_ids) - num_hit
        if num_hit == 0 and num_needed <= 0:
            if new_computed_blocks is not None:
                self._record_query(request, 0)
            return []  # fast path: a decode inside its last block

        blocks = self.blocks
        free_queue = self.free_queue
        # Cached blocks with ref_cnt 0 leave the free queue when taken.
        num_hit_free = 0
        if num_hit:
            for block_id in new_computed_blocks:
                if blocks[block_id].ref_cnt == 0:
                    num_hit_free += 1
        if max(num_needed, 0) + num_hit_free > len(free_queue):
            return None

        if new_computed_blocks is not None:
            for block_id in new_computed_blocks:
                block = blocks[block_id]
                if block.ref_cnt == 0:
                    del free_queue[block_id]
                block.ref_cnt += 1
            block_ids.extend(new_computed_blocks)
            request.num_hashed_blocks = len(block_ids)
            self._record_query(request, num_hit * bs)

        new_blocks: list[int] = []
        for _ in range(num_needed):
            block_id, _ = free_queue.popitem(last=False)
            block = blocks[block_id]
            if block.block_hash is not None:  # evict the least recently used cached block
                del self.hash_to_block[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None
            block.ref_cnt = 1
            new_blocks.append(block_id)
        block_ids.extend(new_blocks)
        return new_blocks

    def _record_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries_total += request.num_tokens
            self.prefix_cache_hits_total += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed, i.e.
        blocks [num_hashed_blocks, num_computed_tokens // block_size).

        Call after the runner has written their KV. If another block already
        holds the same prefix (two requests computed it at the same time),
        this one stays unregistered and is simply freed with its request.
        """
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = request.num_hashed_blocks
        if num_full <= start:
            return
        self._extend_block_hashes(request, num_full)
        hashes = request.block_hashes
        tokens = request.all_token_ids
        block_ids = request.block_ids
        bs = self.block_size
        for i in range(start, num_full):
            h = hashes[i]
            block = self.blocks[block_ids[i]]
            if block.block_hash is None and h not in self.hash_to_block:
                block.block_hash = h
                block.parent_hash = hashes[i - 1] if i else ROOT_HASH
                block.token_ids = tuple(tokens[i * bs : (i + 1) * bs])
                self.hash_to_block[h] = block.block_id
        request.num_hashed_blocks = num_full

    # ------------------------------------------------------------------ release

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first. Idempotent."""
        blocks = self.blocks
        free_queue = self.free_queue
        for block_id in reversed(request.block_ids):
            block = blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free_queue[block_id] = None
                if block.block_hash is None:
                    free_queue.move_to_end(block_id, last=False)  # nothing worth keeping: reuse first
        request.block_ids = []
        request.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks in use
        stay allocated; they just can no longer be found by new requests."""
        for block_id in self.hash_to_block.values():
            block = self.blocks[block_id]
            block.block_hash = block.parent_hash = block.token_ids = None
        self.hash_to_block.clear()
