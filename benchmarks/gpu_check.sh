#!/usr/bin/env bash
# rlhpc on NVIDIA GPUs in a few minutes (well under 10 on one H200; --quick about half that): trainer tokens/s and MFU
# (FSDP2, bf16 compute, fp32 master), the weights broadcast's GB/s against a raw broadcast, and a short RL run's
# tokens/s, all on a Qwen3-0.6B-shaped model built in code. Details: benchmarks/gpu_check.py, docs/gpu.md.
#
#   bash benchmarks/gpu_check.sh [--quick] [--peak-tflops 989] [--only train,broadcast,rl]
#
# Exits 2 with one line when there is no usable NVIDIA GPU; 1 when a check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${RLHPC_PYTHON:-python}
if [[ " $* " != *" --smoke-cpu "* ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no GPU: nvidia-smi not found: this check needs a machine with NVIDIA GPUs and their driver; nothing was run" >&2
    exit 2
fi
if [[ " $* " != *" --smoke-cpu "* ]]; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader >&2 || true
fi
exec "$python" benchmarks/gpu_check.py "$@"
