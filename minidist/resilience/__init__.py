"""Resilience: checkpoints, the supervisor that restarts a failed job, injected faults and stragglers."""
