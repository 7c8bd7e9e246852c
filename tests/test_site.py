"""The course site: reading order, links, pictures, and every page rendering in headless Chromium.

Without MkDocs and Chromium (``pip install -e ".[docs]"``, ``apt-get install chromium``) the build
tests skip with that reason; ``.ci/site`` installs both and runs the same build and check. The rest
reads the repository's files and needs nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def load(name: str):
    """A module of ``docs/`` (not a package: the site's scripts run as ``python docs/NAME.py``)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        spec = importlib.util.spec_from_file_location(f"docs_{name}", ROOT / "docs" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "docs"))


def course_rows() -> list[tuple[str, list[str]]]:
    """(chapter file, exercises) per row of README's course table, in the table's order."""
    course = (ROOT / "README.md").read_text().split("## The course", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in course.splitlines():
        m = re.match(r"\|\s*\w+\s*\|\s*\[[^\]]*\]\((lessons/[\w-]+\.md)", line)
        if m:
            rows.append((m.group(1), re.findall(r"python -m minidist\.grade (\w+)", line)))
    return rows


def test_nav_is_the_course_tables_reading_order():
    nav = re.findall(r"^\s*- (?:[^:\n]+: )?(lessons/[\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    table = list(dict.fromkeys(chapter for chapter, _ in course_rows()))
    assert nav == table
    assert sorted(nav) == sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lessons").glob("*.md"))


def test_every_chapter_links_the_exercises_its_row_names():
    missing = []
    for chapter, exercises in course_rows():
        text = (ROOT / chapter).read_text()
        missing += [f"{chapter}: {n}" for n in exercises
                    if f"](../exercises/{n}.py)" not in text or f"python -m minidist.grade {n}" not in text]
    assert not missing, "chapters that do not link their exercise: " + ", ".join(missing)


def test_every_picture_is_a_small_png_that_its_chapter_shows():
    lessons = load("lessons")
    pictures = sorted((ROOT / "lessons" / "img").glob("*.png"))
    assert pictures, "no lessons/img/*.png: run python docs/make_plots.py"
    expected = {lessons.plot_name(ch, i, c) for ch, cmds in lessons.SMALL.items()
                for i, c in enumerate([cmds] if isinstance(cmds, str) else cmds)}
    for png in pictures:
        name = f"img/{png.name}"
        assert name in expected, f"{name} is drawn by no command of docs/lessons.py"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
        assert png.stat().st_size < 200_000, f"{name} is {png.stat().st_size} bytes: draw it smaller"
        shown = [p for p in (ROOT / "lessons").glob("*.md") if f"]({name})" in p.read_text()]
        assert shown, f"no chapter shows {name} (python docs/expected_output.py --write)"


def test_code_citations_become_links_to_code_pages():
    hooks = load("hooks")
    exists = {"minidist/comm/ring.py", "exercises/allreduce.py", "minidist/comm/"}.__contains__
    text = "\n".join([
        "The ring is `minidist/comm/ring.py` in `minidist/comm/`; `minidist/gone.py` is not there.",
        "Write [`exercises/allreduce.py`](../exercises/allreduce.py); read [chapter 3](03-data-parallel.md).",
        "",
        "    `minidist/comm/ring.py` in an indented code block stays",
        "```",
        "`minidist/comm/ring.py` in a fence stays",
        "```",
        "- a list item: `minidist/comm/ring.py`",
    ])
    got = hooks.link_code(text, "lessons/02-allreduce.md", exists).split("\n")
    assert got[0] == ("The ring is [`minidist/comm/ring.py`](../code/minidist/comm/ring.py.md) in "
                      "[`minidist/comm/`](../code/minidist/comm/index.md); `minidist/gone.py` is not there.")
    assert got[1] == ("Write [`exercises/allreduce.py`](../code/exercises/allreduce.py.md); "
                      "read [chapter 3](03-data-parallel.md).")
    assert got[3:7] == text.split("\n")[3:7]
    assert got[7] == "- a list item: [`minidist/comm/ring.py`](../code/minidist/comm/ring.py.md)"
    # from README (the site's root), the same file is one folder nearer
    assert hooks.link_code("`minidist/comm/ring.py`", "README.md", exists) == \
        "[`minidist/comm/ring.py`](code/minidist/comm/ring.py.md)"
    assert hooks.code_citations(text) == {"minidist/comm/ring.py", "minidist/comm/", "minidist/gone.py"}


def test_a_page_is_judged_by_status_title_and_images():
    check = load("check_site")
    good = {"title": "2. All-reduce - minidist course", "heading": "2. All-reduce", "broken": []}
    assert check.problems(good, 200, "minidist course") == []
    assert check.problems({"title": "minidist course", "heading": "minidist", "broken": []}, 200,
                          "minidist course") == []
    bad = check.problems({"title": "Error response", "heading": "Error response", "broken": ["img/x.png"]},
                         404, "minidist course")
    assert bad[0] == "HTTP status 404" and "title 'Error response'" in bad[1]
    assert bad[2] == "image 'img/x.png' did not load"


def test_the_course_table_gets_its_own_block_and_its_commands_keep_their_words():
    hooks = load("hooks")
    readme = (ROOT / "README.md").read_text()
    wrapped = hooks.course_block(readme)
    before, table = wrapped.split('<div class="course" markdown="1">\n\n', 1)
    table, after = table.split("\n\n</div>", 1)
    assert before + table + after == readme                       # nothing else moved
    rows = table.split("\n")
    assert rows[0].startswith("| # | chapter |") and all(r.startswith("|") for r in rows)
    assert len(rows) == len(course_rows()) + 2                    # header, rule, a row per chapter
    html = ('<div class="course"><table><tr><td><code>python -m a.b --ranks 2</code></td></tr></table></div>'
            "<p><code>elsewhere stays</code></p>")
    assert hooks.keep_words(html) == (
        '<div class="course"><table><tr><td><code><span class="w">python</span> <span class="w">-m</span> '
        '<span class="w">a.b</span> <span class="w">--ranks</span> <span class="w">2</span></code></td></tr>'
        "</table></div><p><code>elsewhere stays</code></p>")
    assert hooks.course_block("# no course here\n") == "# no course here\n"


def test_a_course_table_that_breaks_words_or_overflows_at_1280_px_fails():
    check = load("check_site")
    page = {"title": "minidist course", "heading": "minidist", "broken": []}
    fine = {"words": 198, "split": [], "overflow": 0}
    assert check.problems(page | {"course": fine}, 200, "minidist course") == []
    bad = check.problems(page | {"course": {"words": 198, "split": ["minidist.lessons.allreduce"],
                                            "overflow": 212}}, 200, "minidist course")
    assert bad == ["at 1280 px the course table breaks 1 words of its commands across lines (first: "
                   "'minidist.lessons.allreduce')",
                   "at 1280 px the course table is 212 px wider than the page"]
    assert "not split into words" in check.problems(page | {"course": fine | {"words": 0}}, 200,
                                                    "minidist course")[0]


def _needs_browser():
    for module in ("mkdocs", "material", "playwright"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f'needs {module}: pip install -e ".[docs]"')
    if not Path(CHROMIUM).is_file():
        pytest.skip("needs Chromium: apt-get install chromium (.ci/site installs it)")


def test_chromium_catches_a_broken_image_and_a_wrong_title(tmp_path):
    _needs_browser()
    check = load("check_site")
    (tmp_path / "index.html").write_text("<title>minidist course</title><h1>minidist</h1>")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "index.html").write_text("<title>A - minidist course</title><h1>A</h1>"
                                               "<img src='gone.png'>")
    (tmp_path / "b.html").write_text("<title>Untitled</title><h1>B</h1>")
    failures = check.check(tmp_path, CHROMIUM, "minidist course", course_table=False)
    assert sorted(failures) == ["a/index.html", "b.html"]
    assert failures["a/index.html"] == ["image 'gone.png' did not load"]
    assert "title 'Untitled'" in failures["b.html"][0]


@pytest.mark.slow
def test_the_site_builds_strictly_and_every_page_renders(tmp_path):
    _needs_browser()
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=os.environ | {"NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    check = load("check_site")
    assert (site / "lessons" / "02-allreduce" / "index.html").is_file()
    assert (site / "code" / "minidist" / "comm" / "ring.py" / "index.html").is_file()
    # the chapters, README and a code page here (about a second each on a loaded machine); .ci/site
    # opens every one of the ~200 pages
    pages = [p for p in check.pages(site) if not p.startswith("code/")]
    pages.append("code/minidist/comm/ring.py/index.html")
    failures = check.check(site, CHROMIUM, check.site_name_of(ROOT / "mkdocs.yml"), only=pages)
    assert not failures, "\n".join(f"{p}: {'; '.join(b)}" for p, b in failures.items())
