#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in one call of at most 8 minutes by the parts' limits (367 s
# on an H200 on 11-27, 331 s on 12-04 before part 2 was added; issue 9 §5, issue 11 §5, issue 27): run
# from the repository root on a CUDA machine whose python3 has torch; results go to $OUT (default:
# /tmp/gpu-out), each part's JSON and one log. bench/profile_step.py is the next call where a figure
# needs explaining (where the step's device time goes).
#
#   1. bench/overhead.py --compile: the node's inner steps against bare PyTorch loops, eager and
#      compiled, GPT-2 124M, bf16, seq 1024, batch 8, with MFU (issue 27 §1); each node round's time
#      outside its steps (θ in, Δ out) and, after the reps, one round of each under cProfile (where
#      the host's time goes at batch 8, where the step waits on the host);
#   2. the same, compiled only, at batch 32 (a node's batch once the test has grown it): the goal's
#      figures, 400k tokens/s and 35 % MFU inside the node;
#   3. bench/step_curve.py: the step time of the node's compiled step against the batch size, GPT-2
#      124M and a 1.1B Llama (the simulator's compute model, issue 27 §3);
#   4. bench/gpu.py: a real peer's tokens/s, peak device memory and probed b_max (beside it the
#      memory estimate's, which decides when a node shards the layers), GPT-2 124M, compiled (the
#      default on CUDA), activation checkpointing off.
#
# Each part has its own time limit (seconds, overridable; together 480) and writes its JSON as soon
# as it ends.
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
quiet() { grep --line-buffered -v "^\[transformers\]" | tee -a "$OUT/session.log"; }
timeout "${OVERHEAD_S:-165}" python3 overhead.py --model gpt2-124m --device cuda --precision bf16 \
  --seq-len 1024 --batch-size 8 --inner-steps 10 --reps 5 --codec-mb 0 --compile --profile \
  --out "$OUT/overhead_cuda_124m.json" 2>&1 | quiet
timeout "${OVERHEAD_B32_S:-105}" python3 overhead.py --model gpt2-124m --device cuda --precision bf16 \
  --seq-len 1024 --batch-size 32 --inner-steps 10 --reps 3 --codec-mb 0 --compile \
  --only bare_compiled,node_compiled,node_compiled_at_cap --out "$OUT/overhead_cuda_124m_b32.json" 2>&1 | quiet
timeout "${CURVE_124M_S:-55}" python3 step_curve.py --model gpt2-124m --batch-sizes 1,2,4,8,16,32,64 \
  --out "$OUT/step_curve_124m.json" 2>&1 | quiet
timeout "${CURVE_1B_S:-75}" python3 step_curve.py --model llama-1b --batch-sizes 1,4,8,16 --steps 3 \
  --out "$OUT/step_curve_1b.json" 2>&1 | quiet
timeout "${GPU_124M_S:-80}" python3 gpu.py --models gpt2-124m --checkpointing off --out "$OUT/gpu_124m.json" \
  2>&1 | quiet
