"""Memory techniques: activation checkpointing, mixed precision, optimizer-state offload."""
