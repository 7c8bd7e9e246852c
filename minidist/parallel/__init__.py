"""Parallelism strategies: data, tensor and pipeline parallel building blocks, one idea per module."""
