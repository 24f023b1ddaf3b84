# Source before starting the CPU SGLang build on an x86-64 CPU with AVX-512 and avx512_bf16 but
# no AMX:  . scripts/sglang-cpu-no-amx/env.sh SGLANG_CPU_DIR VENV
# (SGLANG_CPU_DIR: the folder with the CPU build's env.sh; VENV: its virtual environment).
# SGLang keeps its intel_amx attention backend only where torch reports AMX tiles; otherwise it
# falls back to torch_native, which has no EAGLE ("EAGLE is not supported in decode attention
# backend torch_native"). The sitecustomize.py next to this file makes torch report AMX tiles
# in the server's Python, so intel_amx (whose CPU kernels are AVX-512 code, no AMX tile
# instructions in sgl_kernel's common_ops) is kept. Measured: docs/notebook/results.md, 2026-12-04.
. "${1:?usage: . env.sh SGLANG_CPU_DIR VENV}/env.sh" "${2:?usage: . env.sh SGLANG_CPU_DIR VENV}"
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
