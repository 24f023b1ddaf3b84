# Measurement shim for a CPU without AMX (AVX-512 + avx512_bf16): report AMX tiles as supported
# so that SGLang keeps its intel_amx attention backend (EAGLE needs it); the kernels' own CPU
# dispatch is untouched.
import torch

torch.cpu._is_amx_tile_supported = lambda: True
