"""The GPU kernels and custom ops the model calls, one file per concern (as modded-nanogpt keeps its kernels
apart from the model): the LM head with its cross-entropy (and its declared FP8 form), SwiGLU with its down
projection, and the attention backends. Each has a plain-torch path with the same math for CPUs and GPUs
without Triton. registry.py declares the execution choices among them, once each.

Named model_kernels, not kernels: that is the import name of Hugging Face's `kernels` package, which
transformers (5.25 and later) installs and imports, and a folder of that name beside train.py would be found
first (tests/test_imports.py). This file imports no torch, so that a script can import first_calls and start its
helpers before it imports torch (first_calls.start_early).
"""
import importlib.util

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # without importing it (the CPU build has none)


def uses_triton(device):
    """Whether our Triton kernels run on this device: CUDA, with Triton installed."""
    return device.type == "cuda" and TRITON_INSTALLED


# Our @triton.jit kernels launched from inside custom ops (opaque to torch.compile), by their function names: Triton
# compiles them itself, into its own cache, where torch's saved compile artefacts do not reach (compile_cache.py
# carries their entries).
OPAQUE_TRITON_KERNELS = ("cross_entropy_rows_kernel", "transpose_kernel")
