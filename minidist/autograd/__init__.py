"""Autograd: the Tensor and its graph (tensor.py), one forward/backward per op (ops.py), seeded random
state (random.py)."""
