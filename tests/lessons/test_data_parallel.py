"""Lesson 3's timeline plot: a legend of only what it draws, a time axis in milliseconds."""

from matplotlib.axes import Axes

from minidist.lessons import data_parallel_overlap


def test_the_timeline_legend_lists_only_backward_and_the_bucket_all_reduces(tmp_path, monkeypatch):
    seen = {}
    real_legend, real_xlabel = Axes.legend, Axes.set_xlabel

    def legend(self, *a, handles=(), **kw):
        seen["legend"] = [h.get_label() for h in handles]
        return real_legend(self, *a, handles=handles, **kw)

    def xlabel(self, text, *a, **kw):
        seen["x"] = text
        return real_xlabel(self, text, *a, **kw)

    monkeypatch.setattr(Axes, "legend", legend)
    monkeypatch.setattr(Axes, "set_xlabel", xlabel)
    # two ranks: (name, kind, t0, t1) in seconds, as DDP records them
    events = [[("backward", "backward", 0.0, 0.010), ("all-reduce b0", "comm", 0.004, 0.012)],
              [("backward", "backward", 0.001, 0.011), ("all-reduce b0", "comm", 0.005, 0.013)]]
    path = tmp_path / "dp.png"
    data_parallel_overlap.plot(str(path), events)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert seen["legend"] == ["compute (backward)", "collective"]  # no send/recv/wait: none occur
    assert seen["x"] == "time since the first event (ms)"
