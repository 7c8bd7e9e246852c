"""Autograd: the Tensor and its graph (tensor.py), one plain forward/backward per op (ops.py), the fast
forms of the ops a model spends its time in (fused.py), seeded random state (random.py)."""
