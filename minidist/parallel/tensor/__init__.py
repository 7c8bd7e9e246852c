"""Tensor parallelism (Megatron-LM): the conjugate communication functions, the parallel layers, the
tensor-parallel GPT, and sharding as data."""
