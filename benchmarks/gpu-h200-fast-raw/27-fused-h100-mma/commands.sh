#!/usr/bin/env bash
# the tensor-core GEMVs (MMA 1 / 2) beside the FFMA loop: the check, then the 8B 4-bit bench
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
K="mma1:MMA=1 mma2:MMA=2"
timeout 240 python3 benchmarks/gpu_fused.py --out $OUT/check --sections check --specs llama-3.2-1b@4 llama-3-8b@4 qwen3-4b@4 --knobs $K 2>&1 | tail -4
grep -c PASS $OUT/check/gpu_fused.md; grep -ci fail $OUT/check/gpu_fused.md
timeout 320 python3 benchmarks/gpu_fused.py --out $OUT/bench8 --sections bench --specs llama-3-8b@4 llama-3.2-1b@4 --knobs $K 2>&1 | tail -25
# r2 (K widened by sed before the run):
nvidia-smi --query-gpu=name --format=csv | tee $OUT/gpu.txt
K="mma1:MMA=1 mma2:MMA=2 m2t8k:MMA=2,TARGET_WARPS=8192 m2t2k:MMA=2,TARGET_WARPS=2048"
timeout 250 python3 benchmarks/gpu_fused.py --out $OUT/prof --sections profile --specs llama-3-8b@4 --knobs $K 2>&1 | tail -30
timeout 300 python3 benchmarks/gpu_fused.py --out $OUT/bench1 --sections bench --specs llama-3.2-1b llama-3-8b 2>&1 | tail -20
