#!/usr/bin/env bash
# Every GPU check in one call, for a borrowed CUDA machine with little time on it.
#
#     OUT=/some/folder MODEL_SHAPE=path/to/smollm2-135m bash benchmarks/gpu_checks.sh [--quick]
#
# --quick: the headline figures in 200 s (kernel tests, prefill and its steps, paged decode at
# 64 × 4k, int4 at Llama-3-8B's shapes, kernels per token, batch-1 tokens/s); without it every
# section, in 600 s.
# MODEL_SHAPE is a folder holding SmolLM2-135M's config.json and tokenizer files (no weights):
# the script fills it with random bf16 weights of exactly that architecture. Decode and serving
# speed depend on the shapes, not the values (every benchmark here runs with ignore_eos), so the
# throughput figures hold for the real checkpoint; the tests that need SmolLM2's real weights
# skip. Each section has its own time limit and log, so one failure costs only its own figures.
set -u
QUICK=0
case "${1:-}" in
    --quick) QUICK=1 ;;
    "") ;;
    *) echo "usage: OUT=... MODEL_SHAPE=... bash benchmarks/gpu_checks.sh [--quick]" >&2; exit 2 ;;
esac
OUT=${OUT:?set OUT to the folder for logs and JSON}
MODEL_SHAPE=${MODEL_SHAPE:?set MODEL_SHAPE to the SmolLM2 config + tokenizer folder}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
mkdir -p "$OUT"

section() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - start)) s ==="
    tail -n 25 "$OUT/$name.log"
}

{  # 10 s at most, counted in the call's budget
    timeout 3 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    timeout 6 $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
    timeout 1 lscpu | grep -E "Model name|^CPU\(s\)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

MODEL=/tmp/smollm2-135m-random
section random_weights $([ "$QUICK" = 1 ] && echo 20 || echo 45) $PY - "$MODEL_SHAPE" "$MODEL" <<'EOF'
import shutil, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst, dirs_exist_ok=True)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(dst)
print("random SmolLM2-135M-shaped weights in", dst, sum(p.numel() for p in model.parameters()), "parameters")
EOF

# Sections in the order the GPU roofline issue needs them, each with its own time limit, sized so
# that the whole script fits one 600 s call of the device tool (--quick: 200 s, the headline
# figures only). A section that runs over loses only what it had not yet written: bench_gpu.py
# writes its JSON after every row, and its two calls here share one file.
if [ "$QUICK" = 1 ]; then
    # 1. The kernel tests compiled for the GPU (prefill, paged decode, split merge).
    section pytest_triton_cuda 45 $PY -m pytest -q -rfE -p no:cacheprovider --timeout 40 tests/test_triton_kernels.py \
        -k "gpu or rope_write_kv"
    # 2. Prefill against SDPA at 2k and 16k with the kernel's steps at 16k; paged decode at 64 × 4k; int4 at Llama-3-8B.
    section bench_kernels 60 $PY benchmarks/bench_gpu.py --model "$MODEL" --repeats 2 \
        --sections prefill flash_steps decode quant_linears --prefill-lengths 2048 16384 --flash-step-lengths 16384 \
        --decode-batches 64 --decode-contexts 4096 --quant-rows 1 --quant-shapes llama3-8b --out "$OUT"
    # 3. Kernels per batch-1 token, and batch-1 tokens/s with CUDA graphs.
    section profile_step 30 $PY benchmarks/profile_gpu_step.py --model "$MODEL" --tokens 16 --out "$OUT"
    section bench_e2e 35 $PY benchmarks/bench_gpu.py --model "$MODEL" --sections end_to_end --e2e-batches 1 \
        --new-tokens 64 --repeats 2 --out "$OUT"
else
    # 1. Correctness first: the Triton kernels compiled for the GPU (CI runs them only in the
    #    interpreter) — the decode search space, the split merge, the fused kernels, 8-bit KV.
    section pytest_triton_cuda 100 $PY -m pytest -q -rfE -p no:cacheprovider --timeout 60 \
        tests/test_triton_kernels.py tests/test_decode_tuning.py tests/test_prefill_tuning.py tests/test_triton_fused.py \
        tests/test_kv_quant_triton.py tests/test_quant_triton.py
    # 2. Kernels against the hardware: peaks, prefill vs SDPA and the kernel's steps one by one,
    #    paged decode default / tuned / gather+SDPA, quantized linears at SmolLM2's and Llama-3-8B's shapes.
    section bench_kernels 170 $PY benchmarks/bench_gpu.py --model "$MODEL" --repeats 3 \
        --sections prefill flash_steps decode quant_linears --decode-batches 1 64 --decode-contexts 1024 4096 \
        --prefill-lengths 2048 8192 16384 --out "$OUT"
    # 3. One batch-1 token, profiled: kernels per token and the launch gap, fused kernels on and off.
    section profile_step 50 $PY benchmarks/profile_gpu_step.py --model "$MODEL" --tokens 32 --out "$OUT"
    # 4. End-to-end decode, with and without CUDA graphs, against HF generate.
    section bench_e2e 80 $PY benchmarks/bench_gpu.py --model "$MODEL" --sections end_to_end --repeats 3 --out "$OUT"
    # 5. Serving at GPU scale: 1,024 requests, continuous batching, prefix-cached section included.
    section bench_serving 110 $PY benchmarks/bench_serving.py --model "$MODEL" --device cuda --num-requests 1024 \
        --rate 200 --max-num-seqs 256 --skip-hf --out "$OUT"
fi
echo "all sections done"
