"""Imports every module of compiled CPU kernels, so that each registers its binders."""
