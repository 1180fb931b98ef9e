"""The CUDA backend package: backend.py (buffers, stream, copies), module.py (compiling the .cu
kernels), binding.py (launch records), ops.py and matmul.py (which kernel runs each node),
graphs.py (CUDA-graph capture and replay on graph reuse)."""
from ggrun.core.backends.cuda.backend import CUDABackend, describe_device

__all__ = ["CUDABackend", "describe_device"]
