"""Lesson 7's plot: the three runs, their difference from the fp32 twin, the loss scale."""

from minidist.lessons import mixed_precision


def test_the_plot_is_written_with_a_difference_and_a_loss_scale_panel(tmp_path, monkeypatch):
    titles = []
    from matplotlib.axes import Axes

    real = Axes.set

    def spy(self, **kw):
        titles.append(kw.get("title", ""))
        return real(self, **kw)

    monkeypatch.setattr(Axes, "set", spy)
    twin = [4.0, 3.5, 3.2]
    runs = {d: ([(x + e, 1.0, [True]) for x in twin], 0, None) for d, e in (("fp32", 0), ("bf16", 1e-3),
                                                                         ("fp16", 1e-4))}
    log = [(4.0, 65536.0, [True, True]), (3.5, 65536.0, [False, False]), (3.2, 32768.0, [True, True])]
    path = tmp_path / "mp.png"
    mixed_precision.plot(str(path), twin, runs, log)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert any("difference from the serial fp32 twin" in t for t in titles)
    assert any("loss scale (fp16 dynamic scaling" in t and "drops mark overflow steps" in t for t in titles)
