"""Resilience: checkpoints of the state a job hands over, the loop a restart resumes, the supervisor
that restarts a failed job, injected faults and stragglers. Imports no technique."""
