"""Compute kernels that know weight layouts and shapes but no model: numba CPU kernels, the CPU's float products and
oneDNN packing."""
