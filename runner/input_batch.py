"""The persistent batch: one row per running request, preallocated once.

The scheduler sends a diff each step (new requests, block ids appended to
running ones, finished ids). The batch applies it in place:
- `add_request(NewRequestData)` is the ONE write path into a row, for a new
  request and for one resumed after preemption alike;
- `update_requests(...)` appends new block ids of running requests;
- `append_tokens(...)` appends the sampled tokens; or, while they are still
  on the device, `reserve_tokens(...)` appends PLACEHOLDER_TOKEN_ID and
  `fill_tokens(...)` writes the tokens in when they reach the host;
- `remove_request(req_id)` frees a row, and `condense()` moves the last rows
  into the holes so rows 0..num_reqs-1 are exactly the live requests.

A sampling parameter is one field of `SamplingColumns` (with how to read it
from the `NewRequestData`); adding, moving and slicing rows handle every column
generically, and the sampler reads the column by name.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from scheduler.types import Logprob, NewRequestData

logger = logging.getLogger(__name__)

# A token sampled by a step still on the device (see InputBatch.reserve_tokens).
PLACEHOLDER_TOKEN_ID = -1


class CpuGpuBuffer:
    """A host tensor (`.cpu`, numpy view `.np`) and its device twin (`.gpu`).

    On a CPU run `.gpu is .cpu`: no copy, no second allocation.
    """

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """The first n rows on the device."""
        if self.gpu is self.cpu:
            return self.cpu[:n]
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


# ---------------------------------------------------------------------------
# Sampling parameters, column-wise
# ---------------------------------------------------------------------------


def _column(dtype: Any, default: Any, read: Callable[[NewRequestData], Any]) -> Any:
    return field(default=None, metadata={"dtype": dtype, "default": default, "read": read})


def _param(name: str, dtype: Any, default: Any) -> Any:
    """A column holding SamplingParams.<name> as is."""
    return _column(dtype, default, lambda r: getattr(r.sampling_params, name))


def _min_tokens_stop_ids(r: NewRequestData) -> tuple[int, ...]:
    p = r.sampling_params
    eos = () if r.eos_token_id is None or p.ignore_eos else (r.eos_token_id,)
    return tuple(p.stop_token_ids) + eos


@dataclass
class SamplingColumns:
    """One numpy column per sampling parameter, one entry per batch row.

    `allocate(n)` makes n rows of defaults; `write(row, req)` fills a row from
    a NewRequestData; `take(rows)` is the sub-batch of the rows sampling this
    step (same fields, sliced arrays). Adding a parameter is one field here
    plus its use in the sampler.
    """

    temperature: np.ndarray = _param("temperature", np.float32, 1.0)
    top_p: np.ndarray = _param("top_p", np.float32, 1.0)
    top_k: np.ndarray = _param("top_k", np.int32, 0)  # 0: off
    min_p: np.ndarray = _param("min_p", np.float32, 0.0)
    repetition_penalty: np.ndarray = _param("repetition_penalty", np.float32, 1.0)
    frequency_penalty: np.ndarray = _param("frequency_penalty", np.float32, 0.0)
    presence_penalty: np.ndarray = _param("presence_penalty", np.float32, 0.0)
    min_tokens: np.ndarray = _param("min_tokens", np.int32, 0)
    ignore_eos: np.ndarray = _param("ignore_eos", np.bool_, False)
    seed: np.ndarray = _param("seed", object, None)  # int | None
    # -1: no logprobs; 0: only the sampled token's; N: plus the top N
    num_logprobs: np.ndarray = _column(
        np.int32, -1, lambda r: -1 if r.sampling_params.logprobs is None else r.sampling_params.logprobs
    )
    num_prompt_logprobs: np.ndarray = _column(
        np.int32, -1, lambda r: -1 if r.sampling_params.prompt_logprobs is None else r.sampling_params.prompt_logprobs
    )
    logit_bias: np.ndarray = _column(object, None, lambda r: r.sampling_params.logit_bias or None)  # dict | None
    # masked while fewer than min_tokens outputs: stop_token_ids, and the
    # request's EOS unless ignore_eos (the sampler adds the model's EOS ids)
    min_tokens_stop_ids: np.ndarray = _column(object, (), _min_tokens_stop_ids)

    @classmethod
    def allocate(cls, num_rows: int) -> "SamplingColumns":
        cols = {}
        for f in dataclasses.fields(cls):
            arr = np.empty(num_rows, dtype=f.metadata["dtype"])
            arr[:] = [f.metadata["default"]] * num_rows if arr.dtype == object else f.metadata["default"]
            cols[f.name] = arr
        return cls(**cols)

    def write(self, row: int, req: NewRequestData) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name)[row] = f.metadata["read"](req)

    def move(self, src: int, dst: int) -> None:
        for f in dataclasses.fields(self):
            col = getattr(self, f.name)
            col[dst] = col[src]

    def clear(self, row: int) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name)[row] = f.metadata["default"]

    def take(self, rows: np.ndarray) -> "SamplingColumns":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})


# ---------------------------------------------------------------------------
# Block table
# ---------------------------------------------------------------------------


class BlockTable:
    """Block ids per row: [max_num_seqs, max_blocks_per_req] int32 (host
    only: the runner copies the columns a step reads into its own step
    buffer), plus the count of valid entries per row. Entries past a row's
    count hold 0, also in free rows, so a prefix copy moves a whole row."""

    def __init__(self, max_num_seqs: int, max_blocks_per_req: int):
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((max_num_seqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"request needs {end} KV blocks, more than max_blocks_per_req={self.max_blocks_per_req}"
            )
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        # src holds 0 past its count: copying the longer prefix also zeroes dst's stale ids
        n = max(self.num_blocks[src], self.num_blocks[dst])
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = self.num_blocks[src]

    def block_ids(self, row: int) -> list[int]:
        return self.table[row, : self.num_blocks[row]].tolist()


# ---------------------------------------------------------------------------
# The persistent batch
# ---------------------------------------------------------------------------


class InputBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        device: torch.device,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device

        self.req_ids: list[str | None] = [None] * max_num_seqs
        self.req_id_to_row: dict[str, int] = {}
        self._free_rows: list[int] = list(range(max_num_seqs))  # min-heap

        # +1: the token sampled at the last position still gets appended
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)  # prompt + outputs so far
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int32)  # before this step
        # index of the row's last token in the sampled ids of the step that
        # sampled it; read only while that token is PLACEHOLDER_TOKEN_ID
        self.in_flight_index = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_seqs, max_blocks_per_req)
        self.sampling = SamplingColumns.allocate(max_num_seqs)
        # Bumped by every write that adds, removes or moves a row, so that
        # per-row data derived from the columns (the sampler's sub-batch) can
        # be reused while it is unchanged. Token appends do not bump it.
        self.version = 0
        self._sampling_cache: tuple[int, np.ndarray, SamplingColumns] | None = None  # (version, rows, columns)
        # prompt logprobs gathered so far, for requests that asked and whose
        # prefill is not finished; sent (and dropped) when it finishes
        self.prompt_logprobs: dict[str, list[Logprob]] = {}

    # -- queries ---------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.req_id_to_row

    def row_of(self, req_id: str) -> int:
        return self.req_id_to_row[req_id]

    def num_output_tokens(self, row: int) -> int:
        return int(self.num_tokens[row] - self.num_prompt_tokens[row])

    def all_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, : self.num_tokens[row]].tolist()

    def output_token_ids(self, row: int) -> list[int]:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]].tolist()

    def sampling_of(self, rows: np.ndarray) -> SamplingColumns:
        """`sampling.take(rows)`, reused from the last call while no row was
        added, removed or moved since and rows are the same (every decode
        step of a steady batch). Callers must not write into it."""
        cached = self._sampling_cache
        if cached is not None and cached[0] == self.version and np.array_equal(cached[1], rows):
            return cached[2]
        columns = self.sampling.take(rows)
        self._sampling_cache = (self.version, rows.copy(), columns)
        return columns

    # -- writes ----------------------------------------------------------
    def add_request(self, req: NewRequestData) -> int:
        """Put a new or resumed request into the lowest free row; return the row."""
        if req.req_id in self.req_id_to_row:
            raise ValueError(f"request {req.req_id!r} is already in the batch")
        if not self._free_rows:
            raise ValueError(f"the batch is full (max_num_seqs={self.max_num_seqs})")
        num_prompt = len(req.prompt_token_ids)
        num_tokens = num_prompt + len(req.output_token_ids)
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {req.req_id!r} has {num_tokens} tokens, more than max_model_len={self.max_model_len}"
            )
        row = heapq.heappop(self._free_rows)
        self.version += 1
        self.req_ids[row] = req.req_id
        self.req_id_to_row[req.req_id] = row
        self.token_ids[row, :num_prompt] = req.prompt_token_ids
        self.token_ids[row, num_prompt:num_tokens] = req.output_token_ids
        self.num_prompt_tokens[row] = num_prompt
        self.num_tokens[row] = num_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.block_table.set_row(row, req.block_ids)
        self.sampling.write(row, req)
        # Prompt logprobs are produced once, by the prefill of a request that
        # has generated nothing yet (a resumed request already sent them).
        if req.sampling_params.prompt_logprobs is not None and not req.output_token_ids:
            self.prompt_logprobs[req.req_id] = []
            if req.num_computed_tokens > 0:
                logger.warning(
                    "request %s asks for prompt logprobs but its first %d tokens come from the "
                    "prefix cache: their logprobs will be missing",
                    req.req_id,
                    req.num_computed_tokens,
                )
        else:
            self.sampling.num_prompt_logprobs[row] = -1
        return row

    def update_request(self, req_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.update_requests([req_id], [new_block_ids], [num_computed_tokens])

    def update_requests(
        self, req_ids: list[str], new_block_ids: list[list[int]], num_computed_tokens: list[int]
    ) -> None:
        """Running requests, column-wise (a CachedRequestData): append each
        one's new block ids, set its num_computed_tokens."""
        if not req_ids:
            return
        rows = np.fromiter(map(self.req_id_to_row.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        self.num_computed_tokens[rows] = num_computed_tokens
        for i, block_ids in enumerate(new_block_ids):
            if block_ids:  # a decode step gives a new block to 1 request in block_size
                self.block_table.append_row(int(rows[i]), block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token_id
        self.num_tokens[row] = n + 1

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """append_token(rows[i], token_ids[i]) for every i; rows are distinct."""
        n = self.num_tokens[rows]
        self.token_ids[rows, n] = token_ids
        self.num_tokens[rows] = n + 1

    def reserve_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Append a placeholder to each of `rows` (distinct) for the token it
        samples this step, row rows[i] getting sampled id number i; return the
        positions. Counts (num_tokens, outputs) are exact right away, the ids
        come with fill_tokens.
        rows=[3, 0], num_tokens=[.., 7 (row 0), .., 9 (row 3)] -> positions [9, 7]"""
        n = self.num_tokens[rows]
        self.token_ids[rows, n] = PLACEHOLDER_TOKEN_ID
        self.num_tokens[rows] = n + 1
        self.in_flight_index[rows] = np.arange(len(rows))
        return n

    def fill_tokens(self, rows: np.ndarray, positions: np.ndarray, token_ids: np.ndarray) -> None:
        """The sampled ids of placeholders reserved at `positions` of `rows`."""
        if not (self.token_ids[rows, positions] == PLACEHOLDER_TOKEN_ID).all():
            raise RuntimeError("sampled tokens written over tokens that are not placeholders")
        self.token_ids[rows, positions] = token_ids

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's row (a hole until `condense()`); None if absent."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        self.req_ids[row] = None
        self.prompt_logprobs.pop(req_id, None)
        self.sampling.clear(row)
        self.num_tokens[row] = 0
        heapq.heappush(self._free_rows, row)
        return row

    def condense(self) -> None:
        """Move the highest live rows into the lowest holes until the live
        rows are exactly 0..num_reqs-1.

        rows [a, -, b, -, c] -> [a, c, b, -, -]
        """
        num_reqs = self.num_reqs
        holes = sorted(r for r in self._free_rows if r < num_reqs)
        last = self.max_num_seqs - 1
        for hole in holes:
            while self.req_ids[last] is None:
                last -= 1
            self._move_row(last, hole)
            last -= 1
        self._free_rows = list(range(num_reqs, self.max_num_seqs))  # sorted: a valid heap

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None and self.req_ids[dst] is None
        self.version += 1
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_prompt_tokens, self.num_tokens, self.num_computed_tokens, self.in_flight_index):
            arr[dst] = arr[src]
        self.block_table.move_row(src, dst)
        self.sampling.move(src, dst)
        self.sampling.clear(src)
        self.num_tokens[src] = 0
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_row[req_id] = dst
