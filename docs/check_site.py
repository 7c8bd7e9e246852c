"""Open every page of a built site in headless Chromium and check that it rendered.

    python docs/check_site.py SITE_DIR [--chromium /usr/bin/chromium] [--title "minidist course"]

The site is served over HTTP on localhost (as a reader's browser would get it, not from file://)
and each ``*.html`` page is loaded in one fresh Chromium profile (Playwright driving the system's
Chromium: nothing is downloaded), in a window 1280 px wide. A page passes when it answered 200, its
``<title>`` is the site's name or "<its first heading> - <the site's name>" (so a page that lost its
heading, or a server's error page, fails), and every ``<img>`` finished loading with a natural width
> 0 (a missing or corrupt picture fails). The home page's course table must also be readable: in its
``div.course`` (docs/hooks.py), no word of a command broken across lines, nothing scrolled out of
sight. Exit status 1 lists each failing page and why; 0 prints how many passed.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# what the browser reports about a page once it has loaded: its title, its first heading without
# the permalink mark, and the images that did not load
PROBE = """() => {
  const h = document.querySelector('article h1, h1');
  let heading = '';
  if (h) { const c = h.cloneNode(true); c.querySelectorAll('.headerlink').forEach(a => a.remove());
           heading = c.textContent; }
  const broken = Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))
                      .map(i => i.getAttribute('src'));
  const course = document.querySelector('.course');
  let layout = null;
  if (course) {
    const words = Array.from(course.querySelectorAll('code .w'));
    const box = course.querySelector('table').parentElement;
    layout = {words: words.length, split: words.filter(w => w.getClientRects().length > 1)
                                              .map(w => w.textContent),
              overflow: box.scrollWidth - box.clientWidth};
  }
  return {title: document.title, heading: heading, broken: broken, course: layout};
}"""
WIDTH = 1280  # px: the window every page is checked in (a laptop's)


@contextmanager
def serve(root: Path):
    """An HTTP server for the folder ``root`` on a free localhost port; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the report
        pass


def pages(root: Path) -> list[str]:
    """The site's pages as URL paths from its root (``index.html``, ``lessons/01-train/index.html``)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html"))


def problems(report: dict, status: int | None, site_name: str) -> list[str]:
    """What is wrong with one loaded page (``report`` from ``PROBE``), as short phrases; [] when nothing."""
    bad = []
    if status != 200:
        bad.append(f"HTTP status {status}")
    title = " ".join(report["title"].split())
    heading = " ".join(report["heading"].split())
    if title != site_name and title != f"{heading} - {site_name}":
        bad.append(f"title {title!r} is neither {site_name!r} nor '<first heading> - {site_name}' "
                   f"(first heading: {heading!r})")
    bad += [f"image {src!r} did not load" for src in report["broken"]]
    course = report.get("course")
    if course is not None:
        if not course["words"]:
            bad.append("the course table's commands are not split into words (docs/hooks.py keep_words)")
        if course["split"]:
            bad.append(f"at {WIDTH} px the course table breaks {len(course['split'])} words of its commands "
                       f"across lines (first: {course['split'][0]!r})")
        if course["overflow"] > 0:
            bad.append(f"at {WIDTH} px the course table is {course['overflow']} px wider than the page")
    return bad


def check(root: Path, chromium: str, site_name: str, only: list[str] | None = None,
          course_table: bool = True) -> dict[str, list[str]]:
    """{page: problems} for every page of the site in ``root`` that has any (``only``: just those pages;
    ``course_table``: the home page must have the course table, as minidist's does)."""
    from playwright.sync_api import sync_playwright

    failures = {}
    with serve(root) as base, tempfile.TemporaryDirectory(prefix="minidist-chromium-") as profile, \
            sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True,
                                                        args=CHROMIUM_FLAGS)
        try:
            tab = browser.new_page()
            tab.set_viewport_size({"width": WIDTH, "height": 900})
            for page in only if only is not None else pages(root):
                response = tab.goto(base + page, wait_until="load")
                report = tab.evaluate(PROBE)
                bad = problems(report, response.status if response else None, site_name)
                if page == "index.html" and report["course"] is None and course_table:
                    bad.append("the home page has no course table in div.course (docs/hooks.py course_block)")
                if bad:
                    failures[page] = bad
        finally:
            browser.close()
    return failures


def site_name_of(config: Path) -> str:
    """``site_name`` from an mkdocs.yml (read as text: no YAML library needed)."""
    m = re.search(r"^site_name:\s*(.+?)\s*$", config.read_text(encoding="utf-8"), re.M)
    if not m:
        raise ValueError(f"{config} has no site_name line")
    return m.group(1).strip("'\"")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("site", type=Path, help="the folder `mkdocs build -d` wrote")
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium binary (Debian's package)")
    ap.add_argument("--title", help="the site's name (default: site_name in ./mkdocs.yml)")
    args = ap.parse_args(argv)
    if not (args.site / "index.html").is_file():
        ap.error(f"argument site: {args.site} has no index.html; give the folder `mkdocs build -d` wrote")
    if not Path(args.chromium).is_file():
        ap.error(f"argument --chromium: no such file {args.chromium}; install it (apt-get install chromium)")
    name = args.title or site_name_of(Path(__file__).resolve().parent.parent / "mkdocs.yml")
    all_pages = pages(args.site)
    failures = check(args.site, args.chromium, name)
    for page, bad in failures.items():
        print(f"FAIL {page}: " + "; ".join(bad))
    print(f"{len(all_pages) - len(failures)} of {len(all_pages)} pages rendered (title, images)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
