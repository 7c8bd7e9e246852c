"""Runnable lessons: ``python -m minidist.lessons.<name>`` (and under ``mpirun -n N``)."""
