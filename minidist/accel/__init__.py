"""Accelerator plumbing: the array backends (NumPy, CuPy, JAX), the JAX engine and its executable
cache, the compiled SPMD program, deterministic GPU scatter-add."""
