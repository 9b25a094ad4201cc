"""Kernel micro-benchmarks on the GPU: what a decode step's pieces cost.

    python bench/bench_kernels.py --out bench/results/kernels_h200.json

1. The Llama-3.1-8B linears (qkv, o, gate_up, down, lm_head) at batch 1:
   cuBLAS (F.linear), torch.mv, and runner/gemv.py's Triton GEMV over a
   sweep of its configs; and F.linear at 256 rows. Each is timed as a CUDA
   graph of 32 calls over 32 different weight copies (as the 32 layers of a
   step: nothing stays in the 50 MB L2), so the figure is device time per
   call with no launch gaps; bytes / time gives the read bandwidth.
2. A sublayer's entry at batch 1: add + RMSNorm + matmul (qkv) and add +
   RMSNorm + matmul + SiLU-and-mul (gate_up) as the separate kernels against
   runner/gemv.py's fused GEMV over a sweep of its configs.
3. Paged decode attention over the shapes of the offline benchmarks, the
   same way (32 calls per graph): FlashInfer with and without tensor cores,
   and runner/attention/triton_decode.py at its default split count and at
   the best of a sweep.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS = 32
READ_BW = 4.19e12  # B/s, GPU_HOST.md
LINEARS = {  # name: (N, K), Llama-3.1-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def time_graph(fn: Callable[[], None], iters: int = 20) -> float:
    """Milliseconds per call of fn, captured once as a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def fastest_config(label: str, configs: list, run: Callable[[Any], tuple[float, float]]):
    """(ms per call, config, relative error) of the fastest config, where
    run(config) -> (ms per call, relative error); None if none could run.
    A config Triton cannot build (registers, shared memory) is skipped."""
    best = None
    for cfg in configs:
        try:
            t, err = run(cfg)
        except Exception as e:
            print(f"  {label} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg, err)
    return best


def bench_linears(sweep: list) -> dict:
    from runner.gemv import gemv, supports

    dev, dt = torch.device("cuda"), torch.bfloat16
    results = {}
    for name, (N, K) in LINEARS.items():
        copies = 4 if name == "lm_head" else LAYERS  # lm_head: 1 GB, far beyond L2 already
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x1 = torch.randn(1, K, device=dev, dtype=dt)
        x256 = torch.randn(256, K, device=dev, dtype=dt)
        bytes_per_call = N * K * 2
        row: dict = {"N": N, "K": K}

        def per_call(fn) -> float:
            return time_graph(lambda: [fn(w) for w in ws]) / copies

        t = per_call(lambda w: F.linear(x1, w))
        row["cublas_b1_us"], row["cublas_b1_tb_s"] = t * 1e3, bytes_per_call / (t * 1e-3) / 1e12
        t = per_call(lambda w: torch.mv(w, x1[0]))
        row["mv_b1_us"], row["mv_b1_tb_s"] = t * 1e3, bytes_per_call / (t * 1e-3) / 1e12
        t = per_call(lambda w: F.linear(x256, w))
        row["cublas_b256_us"], row["cublas_b256_tflop_s"] = t * 1e3, 2 * 256 * N * K / (t * 1e-3) / 1e12

        ref = F.linear(x1, ws[0]).float()
        best = fastest_config(
            name,
            [cfg for cfg in sweep if supports(x1, ws[0], cfg)],
            lambda cfg: (per_call(lambda w: gemv(x1, w, cfg)),
                         (gemv(x1, ws[0], cfg).float() - ref).abs().max().item() / ref.abs().max().item()),
        )
        if best is not None:
            t, cfg, err = best
            row["triton_b1_us"], row["triton_b1_tb_s"] = t * 1e3, bytes_per_call / (t * 1e-3) / 1e12
            row["triton_config"] = cfg.__dict__
            row["triton_rel_err"] = err
        results[name] = row
        print(f"{name:8s} N={N:6d} K={K:5d}  b1: cuBLAS {row['cublas_b1_us']:7.1f} us {row['cublas_b1_tb_s']:.2f} TB/s"
              f" | mv {row['mv_b1_us']:7.1f} us {row['mv_b1_tb_s']:.2f} TB/s"
              + (f" | triton {row['triton_b1_us']:7.1f} us {row['triton_b1_tb_s']:.2f} TB/s {cfg} err {err:.1e}"
                 if best else "")
              + f"  b256: {row['cublas_b256_us']:7.1f} us {row['cublas_b256_tflop_s']:.0f} TFLOP/s", flush=True)
        del ws
        torch.cuda.empty_cache()
    # one decode step's linears (32 layers + lm_head) with each method's best
    rows = dict(results)
    for key in ("cublas_b1_us", "mv_b1_us", "triton_b1_us"):
        if all(key in r for r in rows.values()):
            total = sum(r[key] * (1 if n == "lm_head" else LAYERS) for n, r in rows.items())
            results[f"step_{key.removesuffix('_us')}_ms"] = total / 1e3
    return results


def bench_fused(sweep: list) -> dict:
    """Unfused kernels against the fused GEMV, per call: qkv and gate_up with
    the residual add + RMSNorm in front."""
    from runner import cuda_ops
    from runner.gemv import NormInput, gemv, supports

    dev, dt = torch.device("cuda"), torch.bfloat16
    results = {}
    for name in ("qkv", "gate_up"):
        N, K = LINEARS[name]
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, K, device=dev, dtype=dt)
        res, nw = torch.randn(1, K, device=dev, dtype=dt), torch.ones(K, device=dev, dtype=dt)
        norm = NormInput(res, nw, 1e-5)
        hx, hres = x.clone(), res.clone()  # the unfused norm works in place on these

        def unfused(w):
            h, _ = cuda_ops.fused_add_rms_norm(hx, hres, nw, 1e-5)
            return cuda_ops.linear(h, w, None)

        def fused(w, cfg):
            return gemv(x, w, cfg, norm=norm)[0]

        def per_call(fn) -> float:
            return time_graph(lambda: [fn(w) for w in ws]) / LAYERS

        row: dict = {"N": N, "K": K, "unfused_us": per_call(unfused) * 1e3}
        r = x.float() + res.float()
        ref = F.linear((r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt), ws[0]).float()
        best = fastest_config(
            f"fused {name}",
            [cfg for cfg in sweep if supports(x, ws[0], cfg)],
            lambda cfg: (per_call(lambda w: fused(w, cfg)),
                         (fused(ws[0], cfg).float() - ref).norm().item() / ref.norm().item()),
        )
        if best is not None:
            t, cfg, err = best
            row["fused_us"], row["fused_tb_s"] = t * 1e3, N * K * 2 / (t * 1e-3) / 1e12
            row["fused_config"], row["fused_rel_err"] = cfg.__dict__, err
        results[name] = row
        print(f"fused {name:8s} unfused {row['unfused_us']:7.1f} us"
              + (f" | fused {row['fused_us']:7.1f} us {row['fused_tb_s']:.2f} TB/s {cfg} err {err:.1e}" if best else ""),
              flush=True)
        del ws
        torch.cuda.empty_cache()
    return results


def bench_decode_attention() -> dict:
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    from runner.attention.triton_decode import DecodeConfig, DecodeScratch, num_splits_for, paged_decode

    dev, dt, page = torch.device("cuda"), torch.bfloat16, 16
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    cases = [  # (label, num_qo_heads, num_kv_heads, head_dim, batch, context)
        (f"{model}_b{batch}_ctx{ctx}", hq, hkv, 128, batch, ctx)
        for model, hq, hkv in (("llama8b", 32, 8), ("qwen3_0.6b", 16, 8))
        for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256)
        for ctx in (256, 1500, 8192)
        if batch * ctx <= 256 * 1500
    ]
    results = {}
    for label, hq, hkv, d, batch, ctx in cases:
        pages_per_req = -(-ctx // page)
        num_pages = batch * pages_per_req
        cache_bytes = num_pages * 2 * page * hkv * d * 2
        copies = max(1, min(LAYERS, int(2e9 // cache_bytes)))
        caches = [torch.randn(num_pages, 2, page, hkv, d, device=dev, dtype=dt) for _ in range(copies)]
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_req
        indices = torch.arange(num_pages, dtype=torch.int32, device=dev)
        last = torch.full((batch,), ctx - (pages_per_req - 1) * page, dtype=torch.int32)
        q = torch.randn(batch, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        row: dict = {"batch": batch, "context": ctx, "heads": [hq, hkv, d]}
        kv_bytes = batch * ctx * 2 * hkv * d * 2
        for tc in (True, False):
            wrapper = BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(num_pages, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=dev),
            )
            wrapper.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)
            calls = [caches[i % copies] for i in range(LAYERS)]
            t = time_graph(lambda: [wrapper.run(q, c, out=out) for c in calls]) / LAYERS
            key = "tensor_cores" if tc else "cuda_cores"
            row[f"{key}_us"], row[f"{key}_tb_s"] = t * 1e3, kv_bytes / (t * 1e-3) / 1e12
        # the one-launch Triton kernel, over the same pages
        table = torch.arange(num_pages, dtype=torch.int32, device=dev).view(batch, pages_per_req)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        scratch = DecodeScratch(dev, batch, hq, hkv, d)
        default = num_splits_for(batch, hkv)
        by_splits = {}
        for splits in sorted({1, 2, 4, 8, 16, 32, default}):
            t = time_graph(lambda: [paged_decode(q, c, table, seq_lens, d**-0.5, scratch, out, splits)
                                    for c in calls]) / LAYERS
            by_splits[splits] = t * 1e3
        row["triton_us"], row["triton_splits"] = by_splits[default], default
        row["triton_best_us"], row["triton_best_splits"] = min((t, s) for s, t in by_splits.items())
        if batch <= 8:  # the tile and pipelining, at the default split count
            configs = {}
            for cfg in (DecodeConfig(bt, w, st) for bt in (32, 64) for w in (4, 8) for st in (1, 2, 3)):
                try:
                    configs[f"{cfg.block_t}/{cfg.num_warps}/{cfg.num_stages}"] = 1e3 * time_graph(
                        lambda: [paged_decode(q, c, table, seq_lens, d**-0.5, scratch, out, default, cfg)
                                 for c in calls]) / LAYERS
                except Exception as e:  # a config Triton cannot build
                    print(f"  triton decode {cfg}: {type(e).__name__}: {str(e)[:120]}")
            row["triton_configs_us"] = configs  # "block_t/num_warps/num_stages": us
            print(f"  {label} triton configs (block_t/warps/stages: us):",
                  ", ".join(f"{k} {v:.1f}" for k, v in sorted(configs.items(), key=lambda kv: kv[1])[:5]))
        row["kv_floor_us"] = kv_bytes / READ_BW * 1e6
        results[label] = row
        print(f"{label:26s} tensor cores {row['tensor_cores_us']:8.1f} us ({row['tensor_cores_tb_s']:.2f} TB/s)"
              f" | CUDA cores {row['cuda_cores_us']:8.1f} us | triton {row['triton_us']:8.1f} us ({default} splits;"
              f" best {row['triton_best_us']:.1f} at {row['triton_best_splits']})"
              f" | KV floor {row['kv_floor_us']:.1f} us", flush=True)
        del caches
        torch.cuda.empty_cache()
    return results


def tensor_cores_from(attention: dict, model: str) -> int:
    """The smallest batch from which the tensor-core decode is at least as fast
    as the CUDA-core one at every measured batch and context (10**9: never)."""
    rows = [r for label, r in attention.items() if label.startswith(model + "_b")]
    threshold = 10**9
    for batch in sorted({r["batch"] for r in rows}, reverse=True):
        if all(r["tensor_cores_us"] <= r["cuda_cores_us"] for r in rows if r["batch"] == batch):
            threshold = batch
        else:
            break
    return threshold


def triton_decode_max_batch(attention: dict, model: str) -> int:
    """The largest batch up to which the Triton decode (default splits) is at
    least as fast as FlashInfer's tensor-core decode at every measured batch
    and context (0: not even at batch 1)."""
    rows = [r for label, r in attention.items() if label.startswith(model + "_b")]
    limit = 0
    for batch in sorted({r["batch"] for r in rows}):
        if all(r["triton_us"] <= r["tensor_cores_us"] for r in rows if r["batch"] == batch):
            limit = batch
        else:
            break
    return limit


def gemv_sweep(block_ns: tuple[int, ...]) -> list:
    """GEMV configs: rows per program from block_ns, by 256-1024 columns, 4 or 8 warps, 2 or 4 stages."""
    from runner.gemv import GemvConfig

    return [
        GemvConfig(block_n=n, block_k=k, num_warps=w, num_stages=s)
        for n, k, w, s in itertools.product(block_ns, (256, 512, 1024), (4, 8), (2, 4))
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/kernels_h200.json")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-linears", action="store_true")
    p.add_argument("--skip-fused", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs CUDA")
    record = {
        "bench": "kernels",
        "host": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "command": "python bench/bench_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "method": "CUDA graph of 32 calls over 32 weight / KV copies, replayed 20 times; device time per call",
    }
    if not args.skip_linears:
        record["linears_bf16"] = bench_linears(gemv_sweep((4, 8, 16)))
    if not args.skip_fused:
        record["fused_b1_bf16"] = bench_fused(gemv_sweep((2, 4, 8)))
    if not args.skip_attention:
        attention = record["decode_attention_bf16"] = bench_decode_attention()
        record["decode_tensor_cores_from"] = {m: tensor_cores_from(attention, m) for m in ("llama8b", "qwen3_0.6b")}
        print("tensor-core decode from batch:", record["decode_tensor_cores_from"])
        record["triton_decode_max_batch"] = {m: triton_decode_max_batch(attention, m) for m in ("llama8b", "qwen3_0.6b")}
        print("Triton decode up to batch:", record["triton_decode_max_batch"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
