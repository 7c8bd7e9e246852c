"""`python -m minidist.calibrate` stays one command after calibrate's split into files of one idea."""

from minidist import calibrate as command
from minidist.plan import calibrate, calibrate_cores, calibrate_kernels, clock


def test_the_command_and_every_name_its_callers_import_are_where_they_were():
    """calibrate_mpi, bench_env and the command import these from `minidist.plan.calibrate`; each is
    the one object defined in its own file."""
    assert command.main is calibrate.main
    assert calibrate._median_time is clock._median_time and calibrate.cpu is clock.cpu
    for name in ("fit_link", "effective_cores", "thread_counts", "allreduce_alpha_beta"):
        assert getattr(calibrate, name) is getattr(calibrate_cores, name)
    for name in ("step_seconds", "kernels", "cold_factor", "WHOLE_GPT"):
        assert getattr(calibrate, name) is getattr(calibrate_kernels, name)
    assert calibrate.cpu_name()
