"""Autograd: the Tensor and its graph (tensor.py), one plain forward/backward per op (ops/), the fast
forms of the ops a model spends its time in (fused.py), seeded random state (random.py)."""
