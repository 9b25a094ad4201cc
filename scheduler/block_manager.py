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
verified against the key the block was registered with, `block_key[b] =
(parent hash, token ids)`: a hash collision whose stored key differs is a
miss, never wrong KV.

Free blocks sit in one LRU queue (oldest first). A freed block keeps its hash
(its KV stays reusable) until it is taken as a fresh block, which evicts the
hash entry. A hit on a free cached block takes it back out of the queue.
Blocks without a hash are freed to the front of the queue (reused first),
and a request frees its blocks tail first, so prompt heads, the most
shareable part, are evicted last.

Invariant: a block is in the free queue iff its ref_cnt is 0.
`hash_to_block` maps each hash to exactly one block whose `block_hash` is it.

Per-block state is kept column-wise (`ref_cnt[b]`, `block_hash[b]`, ...),
the counters and the free queue's links in C arrays, rather than one object
per block: with a few hundred thousand blocks, objects (or an OrderedDict)
would make every full garbage collection of the engine take 15-100 ms.
"""

from __future__ import annotations

from array import array
from typing import Iterator

from scheduler.request import Request

ROOT_HASH = 0x5E4A1  # parent hash of a request's first block


class FreeBlockQueue:
    """Block ids in LRU order (front = evicted first), as a doubly linked list
    over two int arrays: O(1) append, appendleft, popleft and remove from the
    middle, and nothing for the garbage collector to walk.

    Node `num_blocks` is the sentinel: next[S] is the front, prev[S] the back.
    num_blocks=3, all free: next=[1, 2, 3, 0], prev=[3, 0, 1, 2].
    """

    def __init__(self, num_blocks: int) -> None:
        s = num_blocks
        self._sentinel = s
        self._next = array("l", range(1, s + 2))  # next[b] = b + 1: blocks start in id order
        self._next[s] = 0
        self._prev = array("l", range(-1, s))  # prev[b] = b - 1
        self._prev[0] = s
        self._in_queue = bytearray(b"\x01") * num_blocks
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return bool(self._in_queue[block_id])

    def __iter__(self) -> Iterator[int]:
        b = self._next[self._sentinel]
        while b != self._sentinel:
            yield b
            b = self._next[b]

    def append(self, block_id: int) -> None:
        s, nxt, prv = self._sentinel, self._next, self._prev
        back = prv[s]
        nxt[back] = block_id
        prv[block_id] = back
        nxt[block_id] = s
        prv[s] = block_id
        self._in_queue[block_id] = 1
        self._len += 1

    def appendleft(self, block_id: int) -> None:
        s, nxt, prv = self._sentinel, self._next, self._prev
        front = nxt[s]
        prv[front] = block_id
        nxt[block_id] = front
        prv[block_id] = s
        nxt[s] = block_id
        self._in_queue[block_id] = 1
        self._len += 1

    def remove(self, block_id: int) -> None:
        nxt, prv = self._next, self._prev
        before, after = prv[block_id], nxt[block_id]
        nxt[before] = after
        prv[after] = before
        self._in_queue[block_id] = 0
        self._len -= 1

    def popleft(self) -> int:
        block_id = self._next[self._sentinel]
        if block_id == self._sentinel:
            raise IndexError("no free block")
        self.remove(block_id)
        return block_id


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
        # per block b: how many live requests hold it; its hash (set iff it is in
        # hash_to_block) and the key hashed: (hash of the block before, token ids)
        self.ref_cnt = array("l", [0]) * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.free_queue = FreeBlockQueue(num_blocks)  # ref_cnt 0, least recently freed first
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
            if self.block_key[block_id] != (parent, tuple(tokens[i * bs : (i + 1) * bs])):
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

        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        # Cached blocks with ref_cnt 0 leave the free queue when taken.
        num_hit_free = 0
        if num_hit:
            for block_id in new_computed_blocks:
                if ref_cnt[block_id] == 0:
                    num_hit_free += 1
        if max(num_needed, 0) + num_hit_free > len(free_queue):
            return None

        if new_computed_blocks is not None:
            for block_id in new_computed_blocks:
                if ref_cnt[block_id] == 0:
                    free_queue.remove(block_id)
                ref_cnt[block_id] += 1
            block_ids.extend(new_computed_blocks)
            request.num_hashed_blocks = len(block_ids)
            self._record_query(request, num_hit * bs)

        new_blocks: list[int] = []
        block_hash = self.block_hash
        for _ in range(num_needed):
            block_id = free_queue.popleft()
            if block_hash[block_id] is not None:  # evict the least recently used cached block
                self._forget(block_id)
            ref_cnt[block_id] = 1
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
            block_id = block_ids[i]
            if self.block_hash[block_id] is None and h not in self.hash_to_block:
                self.block_hash[block_id] = h
                self.block_key[block_id] = (hashes[i - 1] if i else ROOT_HASH, tuple(tokens[i * bs : (i + 1) * bs]))
                self.hash_to_block[h] = block_id
        request.num_hashed_blocks = num_full

    # ------------------------------------------------------------------ release

    def free(self, request: Request) -> None:
        """Drop the request's references, tail block first. Idempotent."""
        ref_cnt = self.ref_cnt
        free_queue = self.free_queue
        for block_id in reversed(request.block_ids):
            ref_cnt[block_id] -= 1
            if ref_cnt[block_id] == 0:
                if self.block_hash[block_id] is None:
                    free_queue.appendleft(block_id)  # nothing worth keeping: reuse first
                else:
                    free_queue.append(block_id)
        request.block_ids = []
        request.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks in use
        stay allocated; they just can no longer be found by new requests."""
        for block_id in list(self.hash_to_block.values()):
            self._forget(block_id)

    def _forget(self, block_id: int) -> None:
        """Drop a block's prefix-cache entry (its KV is about to be overwritten)."""
        del self.hash_to_block[self.block_hash[block_id]]
        self.block_hash[block_id] = self.block_key[block_id] = None
