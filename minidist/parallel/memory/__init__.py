"""Memory techniques: activation recomputation, mixed precision and FP8, optimizer-state offload."""
