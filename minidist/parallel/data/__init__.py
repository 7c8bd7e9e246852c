"""Data parallelism: DDP, ZeRO, gradient compression, local SGD / DiLoCo."""
