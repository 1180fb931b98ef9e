"""Imports every module of compiled CPU kernels, so that each registers its binders."""
from core.backends.cpu import matmul  # noqa: F401
