#!/usr/bin/env bash
# One call on the H200 host (see /work/shared/GPU_HOST.md): install the wheels
# carried in .whl, reuse FlashInfer kernels compiled by an earlier call
# (.fi_cache/fi_aot.tgz.*), run the named stages under one deadline, and leave
# logs, result JSONs and the compiled kernels in $OUT.
#
#   bench/h200_session.sh smoke bench-small tests          # first call
#   bench/h200_session.sh bench-diag bench-big serve tests # later
#
# Stages: smoke, tests, kernels (bench_kernels.py without the linear sweep), structured (bench_structured.py on the GPU), bench-small (Llama-3.1-8B batch 1 + HF baseline,
# Qwen3-0.6B 256 requests), bench-diag (the same two, no baseline, as *_v2; alone: llama-b1, qwen-256),
# llama-b1-long (batch 1, 8,000 tokens in, 128 out), bench-big (Llama-3.1-8B 1000 x 1000/1000, max_num_seqs 256),
# bench-big384 (the same, max_num_seqs 384), serve. BENCH_FLAGS is appended to
# every `bench offline` command and SUFFIX to the result names, so one call can
# run the script twice: SUFFIX=_v5 ... bench-diag; SUFFIX=_v5_async
# BENCH_FLAGS=--async-scheduling ... bench-diag (the wheels install once).
set -u -o pipefail
OUT=${OUT:-/tmp/serval_out}
DEADLINE=${DEADLINE:-560}   # seconds for all stages; the kernel collection comes after
mkdir -p "$OUT"
START=$SECONDS
LOG="$OUT/log.txt"
export FLASHINFER_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((DEADLINE - (SECONDS - START))); }
SUMMARY=()

# stage NAME MAX_SECONDS CMD...: run CMD with the smaller of MAX_SECONDS and what is left
stage() {
  local name=$1 max=$2; shift 2
  local budget; budget=$(left)
  (( budget > max )) && budget=$max
  if (( budget < 20 )); then log "skip $name (no time left)"; SUMMARY+=("$name: skipped"); return 1; fi
  log "== $name (timeout ${budget}s): $*"
  local t0=$SECONDS
  timeout -k 5 "$budget" "$@" 2>&1 | tee -a "$LOG" ${EXTRA_LOG:+"$EXTRA_LOG"}
  local rc=${PIPESTATUS[0]}
  log "== $name: rc=$rc in $((SECONDS - t0))s"
  SUMMARY+=("$name: rc=$rc $((SECONDS - t0))s")
  return "$rc"
}

export PYTHONPATH=/tmp/site:$PWD
if [ ! -d /tmp/site/flashinfer ]; then
log "install wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -3 | tee -a "$LOG"
AOT=/tmp/site/flashinfer/data/aot
if ls .fi_cache/fi_aot.tgz.* >/dev/null 2>&1; then
  mkdir -p "$AOT" && cat .fi_cache/fi_aot.tgz.* | tar xzf - -C "$AOT" && log "restored $(ls "$AOT" | wc -l) compiled FlashInfer modules"
fi
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"

serve_check() {
  # the server on the GPU (async scheduling, its default there): one completion; 16 at once
  # with a 4000-token stream cut off after 0.5 s (the engine aborts it); then one more
  python3 -m server.cli serve --model llama-3.2-1b --load-format dummy --port 8011 --log-level warning &
  local pid=$! url=localhost:8011/v1/completions ct='content-type: application/json'
  for _ in $(seq 1 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  curl -s $url -H "$ct" -d '{"model": "llama-3.2-1b", "prompt": [128000, 791, 6864, 315, 9822, 374], "max_tokens": 8, "temperature": 0}'
  local rc=$?
  echo
  local pids=()
  for _ in $(seq 1 16); do
    curl -s $url -H "$ct" -o /dev/null -w "%{http_code} " \
      -d '{"model": "llama-3.2-1b", "prompt": [128000, 791], "max_tokens": 64, "ignore_eos": true}' & pids+=($!)
  done
  curl -s -N --max-time 0.5 $url -H "$ct" \
    -d '{"model": "llama-3.2-1b", "prompt": [128000, 791], "max_tokens": 4000, "ignore_eos": true, "stream": true}' | head -c 200
  echo; wait "${pids[@]}"; echo
  curl -s $url -H "$ct" -d '{"model": "llama-3.2-1b", "prompt": [128000, 791], "max_tokens": 4, "temperature": 0}' || rc=1
  echo
  curl -s localhost:8011/metrics | grep -E '^serval:(num_requests_running|request_success_total)' | head -5
  kill "$pid"; wait "$pid"
  return $rc
}

llama_b1() {
  stage llama8b_b1 120 python3 -m server.cli bench offline --model llama-3.1-8b --num-prompts 1 \
    --input-len 128 --output-len 256 --profile-steps 30 --name llama-3.1-8b_b1_128in_256out${SUFFIX:-_v2} --results-dir "$OUT" ${BENCH_FLAGS:-}
}
qwen_256() {
  stage qwen3_0.6b_256 120 python3 -m server.cli bench offline --model qwen3-0.6b --num-prompts 256 \
    --input-len 100:1024 --output-len 100:1024 --max-num-seqs 256 --max-num-batched-tokens 16384 \
    --name qwen3-0.6b_256req_100-1024${SUFFIX:-_v2} --results-dir "$OUT" ${BENCH_FLAGS:-}
}

for s in "$@"; do
  case $s in
    smoke)
      stage smoke 150 python3 -c "
import torch, triton, flashinfer
print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())
from tests.test_runner import make_inputs
from runner.attention import AttentionSpec
from runner.attention.flashinfer import FlashInferAttentionBackend
b = FlashInferAttentionBackend(torch.device('cuda'), torch.bfloat16)
b.configure(AttentionSpec(32, 8, 128, 128 ** -0.5, 16))
inp = make_inputs([0, 20], [7, 1], 16, [[3], [5, 6]], 4, torch.device('cuda'))
class L: scale = 128 ** -0.5
q = torch.randn(8, 32, 128, device='cuda', dtype=torch.bfloat16); k = torch.randn(8, 8, 128, device='cuda', dtype=torch.bfloat16)
cache = torch.zeros(8, 2, 16, 8, 128, device='cuda', dtype=torch.bfloat16)
print('prefill/mixed ok', b.forward(L, q, k, k.clone(), cache, b.build_metadata(inp)).float().abs().mean().item())
" ;;
    tests)
      EXTRA_LOG="$OUT/gpu_tests.log" stage tests 330 python3 -m pytest -m gpu -p no:cacheprovider \
        tests/test_gpu_attention.py tests/test_gpu_cuda_graph.py tests/test_gpu_engine.py \
        tests/test_runner.py tests/test_engine_parity.py tests/test_sampler.py tests/test_async_scheduling.py -v -rs ;;
    bench-small)
      stage llama8b_b1 200 python3 -m server.cli bench offline --model llama-3.1-8b --num-prompts 1 \
        --input-len 128 --output-len 256 --gpu-memory-utilization 0.7 --baseline-hf --baseline-new-tokens 32 \
        --profile-steps 30 --name llama-3.1-8b_b1_128in_256out --results-dir "$OUT" ${BENCH_FLAGS:-}
      stage qwen3_0.6b_256 150 python3 -m server.cli bench offline --model qwen3-0.6b --num-prompts 256 \
        --input-len 100:1024 --output-len 100:1024 --max-num-seqs 256 --max-num-batched-tokens 16384 \
        --name qwen3-0.6b_256req_100-1024 --results-dir "$OUT" ${BENCH_FLAGS:-} ;;
    bench-diag) llama_b1; qwen_256 ;;
    llama-b1) llama_b1 ;;
    llama-b1-long)
      stage llama8b_b1_long 90 python3 -m server.cli bench offline --model llama-3.1-8b --num-prompts 1 \
        --input-len 8000 --output-len 128 --name llama-3.1-8b_b1_8000in_128out${SUFFIX:-} --results-dir "$OUT" ${BENCH_FLAGS:-} ;;
    qwen-256) qwen_256 ;;
    bench-big384)
      stage llama8b_1000_384 240 python3 -m server.cli bench offline --model llama-3.1-8b --num-prompts 1000 \
        --input-len 1000 --output-len 1000 --max-num-seqs 384 --max-num-batched-tokens 8192 \
        --name llama-3.1-8b_1000req_1000in_1000out_seqs384${SUFFIX:-} --results-dir "$OUT" ${BENCH_FLAGS:-} ;;
    bench-big)
      stage llama8b_1000 300 python3 -m server.cli bench offline --model llama-3.1-8b --num-prompts 1000 \
        --input-len 1000 --output-len 1000 --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --name llama-3.1-8b_1000req_1000in_1000out${SUFFIX:-} --results-dir "$OUT" ${BENCH_FLAGS:-} ;;
    kernels)
      # micro-benchmarks: fused norm+GEMV against the unfused kernels; decode attention (FlashInfer, Triton)
      stage kernels 240 python3 bench/bench_kernels.py --skip-linears --out "$OUT/kernels${SUFFIX:-}.json" ;;
    structured)
      # guided decoding on the GPU: SmolLM2-135M shape, dummy weights, the real tokenizer
      # (.gpu_models/smollm2-135m: config.json + tokenizer files, carried; not in git)
      stage structured 180 python3 bench/bench_structured.py --model .gpu_models/smollm2-135m \
        --load-format dummy --device cuda --out "$OUT/structured_cuda.json" ;;
    serve)
      export -f serve_check
      stage serve 150 bash -c serve_check ;;
    *) log "unknown stage $s" ;;
  esac
done

# Bring back what FlashInfer compiled, as AOT modules the next call loads without ninja.
log "collect compiled FlashInfer modules"
rm -rf /tmp/aot && mkdir -p /tmp/aot
find "$HOME/.cache/flashinfer" -path '*cached_ops*' -name '*.so' 2>/dev/null | while read -r so; do
  name=$(basename "$so" .so); mkdir -p "/tmp/aot/$name" && cp "$so" "/tmp/aot/$name/"
done
if [ -n "$(ls /tmp/aot)" ]; then
  tar czf - -C /tmp/aot . | split -b 15M - "$OUT/fi_aot.tgz."
  log "kernels: $(ls /tmp/aot | tr '\n' ' ') -> $(du -ch "$OUT"/fi_aot.tgz.* | tail -1)"
fi
log "summary"
printf '  %s\n' "${SUMMARY[@]}" | tee -a "$LOG"
for f in "$OUT"/*.json; do
  [ -f "$f" ] && python3 - "$f" <<'EOF' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))
if "metrics" not in r:
    sys.exit(0)
m, fl = r["metrics"], r["floor"]
line = f"{sys.argv[1].rsplit('/', 1)[-1]}: out {m['output_tok_s']:.0f} tok/s, total {m['total_tok_s']:.0f} tok/s, run/floor speed {fl['achieved_over_floor']:.2f}"
if "ms_per_decode_step" in m:
    line += f", decode {m['ms_per_decode_step']:.3f} ms (floor {fl['ms_per_decode_step']:.3f}, batch {m['mean_decode_batch']:.0f})"
if "gpu_idle_fraction" in m:
    line += (f", GPU idle {100 * m['gpu_idle_fraction']:.1f}% (kernel gaps {100 * m.get('gpu_idle_between_kernels_fraction', 0):.1f}%,"
             f" host {100 * m.get('gpu_idle_waiting_host_fraction', 0):.1f}%, {m.get('gpu_kernels_per_step', 0):.0f} kernels/step)")
if "ms_host_prepare_inputs" in m:
    line += (f"; host ms prepare {m['ms_host_prepare_inputs']:.2f} launch {m['ms_host_forward_launch']:.2f}"
             f" wait {m['ms_wait_for_gpu']:.2f} sched {m['ms_engine_outside_runner']:.2f}")
line += f", preempt {m['num_preemptions']}, kv {m['kv_cache_tokens']}"
b = r.get("baseline") or {}
if "ms_per_decode_step" in b:
    line += f"; HF {b['ms_per_decode_step']:.1f} ms/step, {b['output_tok_s']:.0f} tok/s"
print(line)
EOF
done
