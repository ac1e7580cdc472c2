#!/usr/bin/env bash
# The H200 benchmark set (see ../shared/gpu/README.md): run through the device tool as
#   bash .gpu/b/device-2.sh bash benchmarks/gpu_h200.sh [bench|kv|hybrid|moe [SHAPE...]]
# Writes markdown tables and a results table under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
what=${1:-bench}
run() { echo "### \`$*\`"; echo; "$@"; echo; }
if [ "$what" = bench ]; then
  for m in llama-3.2-1b llama-3-8b; do
    for q in "" "--quant 4"; do
      run python3 -m mlxbun.cli bench --model "random:$m" --dtype bfloat16 $q --prompt-len 512 --gen-len 128 \
        --trials 10 --results "$OUT/results.sqlite"
    done
  done > "$OUT/bench.md" 2> "$OUT/bench.err"
elif [ "$what" = moe ]; then
  # 1. the MoE rows' float16 / bfloat16 experts, which mlx's CPU gather_mm refuses: mlxbun port holds
  #    them to mlx-lm live on CUDA (teacher-forced prefill and greedy decode logits, bit for bit)
  #    (PORT_ARCHS="a b": those zoo archs only; "none": skip)
  archs=${PORT_ARCHS:-$(python3 -c "from mlxbun.zoo.archs import moe_archs; print(' '.join(moe_archs()))")}
  if [ "$archs" != none ]; then
    python3 -m mlxbun.cli port $(printf 'zoo:%s ' $archs) --variants float16,bfloat16 --no-goldens \
      --zoo-cache /tmp/zoo > "$OUT/moe-port.txt" 2> "$OUT/moe-port.err"
  fi
  # 2. the MoE shapes, bf16 and 4-bit, mlxbun vs mlx-lm on the same weights
  shift
  for m in ${@:-qwen3-30b-a3b gpt-oss-20b}; do
    for q in "" "--quant 4"; do
      run python3 -m mlxbun.cli bench --model "random:$m" --dtype bfloat16 $q --prompt-len 512 --gen-len 128 \
        --trials 5 --results "$OUT/results.sqlite"
    done
  done > "$OUT/bench-moe.md" 2> "$OUT/bench-moe.err"
elif [ "$what" = hybrid ]; then
  # the hybrid rows on CUDA, every variant (float16 / bfloat16 experts included, which mlx's CPU
  # gather_mm refuses): mlxbun port holds them to mlx-lm live on the same backend, where mlx-lm's
  # recurrent kernels take their non-Metal path (PORT_ARCHS="a b": those zoo archs only)
  archs=${PORT_ARCHS:-$(python3 -c "from mlxbun.zoo.archs import hybrid_archs; print(' '.join(hybrid_archs()))")}
  python3 -m mlxbun.cli port $(printf 'zoo:%s ' $archs) --variants float32,float16,bfloat16,q4,q8,mixed \
    --no-goldens --zoo-cache /tmp/zoo > "$OUT/hybrid-port.txt" 2> "$OUT/hybrid-port.err"
elif [ "$what" = kv ]; then
  python3 -m mlxbun.bench.kv_memory --contexts 1024,4096,16384 --decode 32 --results "$OUT/results.sqlite" \
    > "$OUT/kv_memory.md" 2> "$OUT/kv_memory.err"
fi
echo "done: $what"
