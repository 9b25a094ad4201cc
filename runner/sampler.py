"""Batched sampling over the rows that sample this step.

Order of operations on the logits (float32, [num_rows, vocab]):
 1. logit_bias                          (OpenAI: added to the logit)
 2. min_tokens                          (EOS unless ignore_eos, and stop_token_ids -> -inf
                                         while fewer than min_tokens outputs)
 3. repetition penalty                  (HF/vLLM: over prompt + output tokens, positive
                                         logits divided by it, negative multiplied)
 4. frequency / presence penalties      (OpenAI: over output tokens,
                                         logit -= freq * count + presence * (count > 0))
 4b. guided decoding                    (grammar bitmask: disallowed tokens -> -inf)
    -> logprobs_mode="processed" takes logprobs HERE (after penalties,
       bias, min_tokens and the grammar, before temperature/top-k/top-p/min-p).
       The default, "raw", takes them from the model's logits before step 1,
       as vLLM and OpenAI report them: the model's own distribution.
 5. greedy rows (temperature ~ 0, or top_k == 1): argmax, done
 6. temperature, top-k, top-p, min-p, then a draw.

The draw is argmax(probs / E) with E ~ Exp(1) i.i.d. per vocab entry, which
samples exactly from probs. E for a seeded row comes from its own generator,
seeded from (seed, number of tokens it has generated so far), so the row's
tokens do not depend on what else is in the batch and survive preemption;
unseeded rows share one generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner.input_batch import InputBatch, SamplingColumns
from runner.structured_output import apply_token_bitmask
from scheduler.types import Logprob

_MASK64 = (1 << 64) - 1
_GREEDY_EPS = 1e-5  # temperature below this is greedy, as SamplingParams.greedy


def step_seed(seed: int, num_generated: int) -> int:
    """A well-mixed 64-bit seed for (request seed, output position) (splitmix64)."""
    x = (seed + 0x9E3779B97F4A7C15 * (num_generated + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingMetadata:
    """The rows sampling this step, in the order of the logits rows."""

    params: SamplingColumns  # numpy columns, one entry per row
    num_prompt_tokens: np.ndarray  # [num_rows] int32
    num_tokens: np.ndarray  # [num_rows] int32, prompt + outputs so far
    # token ids of row i are all_token_ids[token_rows[i], :num_tokens[i]];
    # sliced only when a penalty needs them
    all_token_ids: np.ndarray  # [>= num_rows, >= max(num_tokens)] int32
    token_rows: np.ndarray  # [num_rows] int64
    # guided decoding: rows bitmask_rows[k] may only sample the tokens whose
    # bit is set in token_bitmask[k] (runner.structured_output's layout)
    token_bitmask: torch.Tensor | None = None  # [num_guided, ceil(vocab / 32)] int32, on the device
    bitmask_rows: np.ndarray | None = None  # [num_guided] int64, rows of the logits

    @classmethod
    def from_batch(cls, batch: InputBatch, rows: np.ndarray) -> "SamplingMetadata":
        return cls(
            params=batch.sampling_of(rows),
            num_prompt_tokens=batch.num_prompt_tokens[rows],
            num_tokens=batch.num_tokens[rows],
            all_token_ids=batch.token_ids,
            token_rows=rows,
        )

    @property
    def num_rows(self) -> int:
        return len(self.num_tokens)

    @property
    def num_output_tokens(self) -> np.ndarray:
        return self.num_tokens - self.num_prompt_tokens

    def token_ids(self) -> np.ndarray:
        """[num_rows, max(num_tokens)] int32, valid up to num_tokens per row."""
        max_len = int(self.num_tokens.max()) if self.num_rows else 0
        return self.all_token_ids[self.token_rows, :max_len]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    logprobs: list[Logprob | None] | None  # None when no row asked


class Sampler:
    def __init__(
        self,
        eos_token_ids: list[int] | tuple[int, ...],
        device: torch.device,
        seed: int = 0,
        logprobs_mode: str = "raw",
    ):
        if logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode must be 'processed' or 'raw', got {logprobs_mode!r}")
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_rows, vocab] (any float dtype; processed in float32, on a copy)."""
        p = meta.params
        want_logprobs = p.num_logprobs >= 0
        greedy = (p.temperature < _GREEDY_EPS) | (p.top_k == 1)
        if greedy.all() and not want_logprobs.any() and not self.has_processors(meta):
            # plain greedy: argmax of the logits as they come (bfloat16 -> float32 is exact, so the
            # same token), without a float32 copy of the [rows, vocab] logits
            return SamplerOutput(logits.argmax(dim=-1), None)
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        logprobs = None
        if want_logprobs.any() and self.logprobs_mode == "raw":
            logprobs = torch.log_softmax(logits, dim=-1)

        logits = self.process_logits(logits, meta)
        if want_logprobs.any() and logprobs is None:
            logprobs = torch.log_softmax(logits, dim=-1)

        tokens = logits.argmax(dim=-1)
        random_rows = np.flatnonzero(~greedy)
        if random_rows.size:
            idx = _index(random_rows, logits.device)
            tokens[idx] = self._sample_random(logits[idx], meta, random_rows)

        out_logprobs = None
        if logprobs is not None:
            out_logprobs = [None] * meta.num_rows
            rows = np.flatnonzero(want_logprobs)
            idx = _index(rows, logits.device)
            made = make_logprobs(logprobs[idx], tokens[idx], p.num_logprobs[rows].tolist())
            for row, lp in zip(rows.tolist(), made):
                out_logprobs[row] = lp
        return SamplerOutput(tokens, out_logprobs)

    @staticmethod
    def has_processors(meta: SamplingMetadata) -> bool:
        """Whether process_logits would change any row (the checks of its steps, on the host)."""
        p = meta.params
        return bool(
            meta.token_bitmask is not None
            or (p.logit_bias != None).any()  # noqa: E711 (object column)
            or (meta.num_output_tokens < p.min_tokens).any()
            or (p.repetition_penalty != 1.0).any()
            or (p.frequency_penalty != 0.0).any()
            or (p.presence_penalty != 0.0).any()
        )

    def process_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Steps 1-4b (logit_bias, min_tokens, penalties, grammar bitmask), in
        place on float32 logits [num_rows, vocab]; returns them."""
        self._apply_logit_bias(logits, meta)
        self._apply_min_tokens(logits, meta)
        self._apply_penalties(logits, meta)
        if meta.token_bitmask is not None:
            apply_token_bitmask(logits, meta.token_bitmask, _index(meta.bitmask_rows, logits.device))
        return logits

    # -- logits processors (in place) -------------------------------------
    def _apply_logit_bias(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        vocab = logits.shape[1]
        rows, toks, vals = [], [], []
        for row in np.flatnonzero(meta.params.logit_bias != None).tolist():  # noqa: E711 (object column)
            for tok, bias in meta.params.logit_bias[row].items():
                if tok < vocab:
                    rows.append(row)
                    toks.append(tok)
                    vals.append(bias)
        if rows:
            dev = logits.device
            idx = (_h2d(np.array(rows, dtype=np.int64), dev), _h2d(np.array(toks, dtype=np.int64), dev))
            logits.index_put_(idx, _h2d(np.array(vals, dtype=np.float32), dev).to(logits.dtype), accumulate=True)

    def _apply_min_tokens(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        p = meta.params
        vocab = logits.shape[1]
        rows, toks = [], []
        for row in np.flatnonzero(meta.num_output_tokens < p.min_tokens).tolist():
            stop = set(p.min_tokens_stop_ids[row])
            if not p.ignore_eos[row]:
                stop.update(self.eos_token_ids)
            for tok in stop:
                if tok < vocab:
                    rows.append(row)
                    toks.append(tok)
        if rows:
            dev = logits.device
            logits[_h2d(np.array(rows, dtype=np.int64), dev), _h2d(np.array(toks, dtype=np.int64), dev)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, meta: SamplingMetadata) -> None:
        p = meta.params
        use_rep = p.repetition_penalty != 1.0
        use_freq_pres = (p.frequency_penalty != 0.0) | (p.presence_penalty != 0.0)
        if not (use_rep.any() or use_freq_pres.any()):
            return
        num_rows, vocab = logits.shape
        dev = logits.device
        token_ids = meta.token_ids()
        cols = np.arange(token_ids.shape[1])[None, :]
        valid = cols < meta.num_tokens[:, None]
        if ((token_ids < 0) & valid).any():  # PLACEHOLDER_TOKEN_ID: sampled by a step still in flight
            raise RuntimeError("penalties need every earlier token on the host: no step may be in flight")
        # token ids, with positions past a row's length sent to a spill column
        # `vocab` that is dropped: num_tokens=[2], ids=[[5, 7, 0]] -> [[5, 7, V]]
        ids = np.where(valid & (token_ids < vocab), token_ids, vocab).astype(np.int64)
        if use_rep.any():
            seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=dev)
            seen.scatter_(1, _h2d(ids, dev), True)
            seen = seen[:, :vocab]
            pen = _h2d(p.repetition_penalty, dev)[:, None]
            penalised = torch.where(logits > 0, logits / pen, logits * pen)
            logits.copy_(torch.where(seen, penalised, logits))
        if use_freq_pres.any():
            is_output = cols >= meta.num_prompt_tokens[:, None]
            out_ids = _h2d(np.where(is_output, ids, vocab), dev)
            counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=dev)
            counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
            counts = counts[:, :vocab]
            freq = _h2d(p.frequency_penalty, dev)[:, None]
            pres = _h2d(p.presence_penalty, dev)[:, None]
            logits -= freq * counts + pres * (counts > 0).to(logits.dtype)

    # -- random sampling ----------------------------------------------------
    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata, rows: np.ndarray) -> torch.Tensor:
        """logits: [len(rows), vocab] of the non-greedy rows -> sampled ids [len(rows)]."""
        p = meta.params
        dev = logits.device
        temperature = _h2d(p.temperature[rows], dev)[:, None]
        logits = logits / temperature

        top_k = p.top_k[rows]
        top_p = p.top_p[rows]
        filtered = np.flatnonzero((top_k > 0) | (top_p < 1.0))
        if filtered.size:
            idx = _index(filtered, dev)
            logits[idx] = _top_k_top_p(logits[idx], top_k[filtered], top_p[filtered], sync_free=logits.is_cuda)
        min_p = p.min_p[rows]
        if (min_p > 0).any():
            probs = logits.softmax(dim=-1)
            threshold = _h2d(min_p, dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        probs = logits.softmax(dim=-1)

        noise = torch.empty_like(probs)
        seeds = p.seed[rows]
        seeded = np.flatnonzero(seeds != None)  # noqa: E711 (object column)
        unseeded = np.flatnonzero(seeds == None)  # noqa: E711
        if unseeded.size:
            noise[_index(unseeded, dev)] = torch.empty(
                (unseeded.size, probs.shape[1]), dtype=probs.dtype, device=dev
            ).exponential_(generator=self.generator)
        num_out = meta.num_output_tokens[rows]
        for i in seeded.tolist():
            gen = torch.Generator(device=dev)
            gen.manual_seed(step_seed(int(seeds[i]), int(num_out[i])))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _h2d(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. To a GPU through pinned memory with a
    non-blocking copy, so the host does not wait for the forward pass queued
    before it (a copy from pageable memory would); torch's pinned allocator
    keeps the staging buffer alive until the copy has run."""
    t = torch.from_numpy(array)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _index(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    return _h2d(rows.astype(np.int64), device)


# On the CPU, top-p without top-k looks for its cut among this many most likely
# tokens first, and sorts the whole vocabulary only when their mass is below
# top_p. On a GPU that check would make the host wait for the step's logits
# (`sync_free`): there the whole vocabulary is sorted at once.
_TOP_P_CANDIDATES = 1024


def _top_k_top_p(logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray, sync_free: bool = False) -> torch.Tensor:
    """Rows that filter (top_k > 0 or top_p < 1): mask all but the top_k
    largest logits, then all but the smallest prefix of the (renormalised)
    sorted distribution whose mass reaches top_p.
    probs sorted [0.5, 0.3, 0.2], top_p=0.7 -> keep [0.5, 0.3].
    sync_free: never read a device value on the host (the GPU path)."""
    vocab = logits.shape[1]
    has_k = top_k > 0
    k = np.where(has_k, np.minimum(top_k, vocab), vocab)
    top_p_alone = (~has_k).any()
    if top_p_alone and sync_free:
        return _top_k_top_p_among(logits, k, top_p, vocab)  # all candidates: no fallback to decide
    num_candidates = int(max(k[has_k].max(initial=0), _TOP_P_CANDIDATES if top_p_alone else 0))
    out = _top_k_top_p_among(logits, k, top_p, min(num_candidates, vocab))
    if out is None:  # some top-p cut lies beyond the candidates
        out = _top_k_top_p_among(logits, k, top_p, vocab)
    return out


def _top_k_top_p_among(
    logits: torch.Tensor, k: np.ndarray, top_p: np.ndarray, num_candidates: int
) -> torch.Tensor | None:
    """The filter, looking only at each row's num_candidates most likely
    tokens (every token outside them is dropped); None when a row's cut may
    lie outside them."""
    dev = logits.device
    vals, ids = logits.topk(num_candidates, dim=-1)  # sorted, descending
    ranks = torch.arange(num_candidates, device=dev)[None, :]
    k_t = _h2d(k, dev)[:, None]
    vals = vals.masked_fill(ranks >= k_t, float("-inf"))
    if (top_p < 1.0).any():
        # normaliser: over the kept top-k tokens, or the whole row without top-k
        full = _h2d(k == logits.shape[1], dev)
        lse = torch.where(full, logits.logsumexp(dim=-1), vals.logsumexp(dim=-1))[:, None]
        probs = (vals - lse).exp()
        cum = probs.cumsum(dim=-1)
        p = _h2d(top_p, dev)[:, None]
        if num_candidates < logits.shape[1] and bool(((cum[:, -1:] < p) & full[:, None]).any()):
            return None
        drop = (cum - probs >= p) & (p < 1.0)
        drop[:, 0] = False  # the most likely token always stays
        vals = vals.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, vals)


def make_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[Logprob]:
    """logprobs: [n, vocab] log-softmaxed; token_ids: [n] the chosen ids;
    num_top[i]: how many top entries row i wants (0: only the chosen one).

    rank is 1 + the number of tokens strictly more likely than the chosen one.
    """
    if logprobs.shape[0] == 0:
        return []
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids[:, None])  # [n, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    max_top = max(num_top)
    if max_top > 0:
        top_lp, top_ids = logprobs.topk(max_top, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    chosen_ids, chosen_lp = token_ids.tolist(), chosen[:, 0].tolist()
    out = []
    for i, n in enumerate(num_top):
        ids, lps = [chosen_ids[i]], [chosen_lp[i]]
        if n > 0:
            ids += top_ids[i][:n]
            lps += top_lp[i][:n]
        out.append(Logprob(token_ids=ids, logprobs=lps, rank=ranks[i]))
    return out
