#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in one call (issue 9 §5, issue 11 §5): run from the
# repository root on a CUDA machine whose python3 has torch; results go to $OUT (default: /tmp/gpu-out).
#
#   1. bench/overhead.py: the node's inner steps against a bare PyTorch loop, GPT-2 124M, bf16,
#      seq 1024, batch 8 (and the codecs' speed on one core of that machine);
#   2. bench/gpu.py: tokens/s, peak device memory and the probed b_max of GPT-2 124M and a 1.1B
#      Llama, activation checkpointing off and on.
#
# The package is put on the path through a link named `adloco` (the repository root is the package);
# wheels in .whl/ (transformers at our pinned version) are installed to /tmp/site first when present.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/pkg
ln -sfn "$PWD" /tmp/pkg/adloco
export PYTHONPATH=/tmp/pkg
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:/tmp/pkg
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
cd bench
timeout "${OVERHEAD_S:-150}" python3 overhead.py --model gpt2-124m --device cuda --precision bf16 \
  --seq-len 1024 --batch-size 8 --inner-steps 10 --reps 5 --codec-mb 64 --out "$OUT/overhead_cuda_124m.json" \
  2>&1 | grep -v "^\[transformers\]" | tee "$OUT/overhead.log"
timeout "${GPU_124M_S:-150}" python3 gpu.py --models gpt2-124m --out "$OUT/gpu_124m.json" 2>&1 \
  | grep -v "^\[transformers\]" | tee "$OUT/gpu_124m.log"
timeout "${GPU_1B_S:-240}" python3 gpu.py --models llama-1b --out "$OUT/gpu_1b.json" 2>&1 \
  | grep -v "^\[transformers\]" | tee "$OUT/gpu_1b.log"
