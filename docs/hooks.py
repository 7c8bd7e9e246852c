"""MkDocs hooks that turn the repository itself into the course site, moving nothing.

The chapters stay where README and the tests cite them (``lessons/NN-*.md``) and README stays the
front page: ``on_files`` adds them to the site under their repository paths, so every relative link
that works on GitHub (``lessons/01-train.md`` from README, ``img/01-train.png`` or
``../exercises/autograd.py`` from a chapter) works on the site too. Code has no page of its own in
MkDocs, so each file a chapter or README cites -- as a link or as a backquoted path like
`` `minidist/comm/collectives.py` `` -- gets a generated page, ``code/<path>.md``, that shows the
file; ``on_page_markdown`` points those citations at it. ``mkdocs build --strict`` then fails on any
link that leads nowhere.

The rewriting is plain functions of text (``code_citations``, ``link_code``) so that
``tests/test_site.py`` can check it without MkDocs installed.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lessons").glob("*.md"))]
STATIC = ["lessons/img/*.png", "notebooks/*.ipynb"]
CODE_ROOTS = ("minidist/", "exercises/", "benchmarks/", "tests/", "docs/", "notebooks/")
CODE_SUFFIXES = {".py": "python", ".json": "json", ".toml": "toml", ".txt": "text", ".sh": "bash", "": "bash"}

# `minidist/comm/collectives.py`, `tests/comm/test_ledger.py::test_ring`, `minidist/comm/`
_ROOTS = "|".join(map(re.escape, CODE_ROOTS))
BACKQUOTED = re.compile(rf"(?<![\[\w])`((?:{_ROOTS})[\w./-]*?)(?:::\w+)?`(?!\])")
NOT_CODE = (".md", ".png", ".ipynb")  # pages and files the site shows as they are
# [text](target) whose target is a relative path (no scheme, no leading /, not an anchor)
LINK = re.compile(r"(\]\()(?![a-z]+:|/|#)([^)\s#]+)(#[^)\s]*)?(\))")


def _prose_lines(text: str):
    """(index, line) of the lines outside code: fenced blocks and indented code blocks are skipped."""
    fenced, code, previous_blank = False, False, True
    for i, line in enumerate(text.split("\n")):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        blank = not line.strip()
        if not fenced:
            indented = line.startswith(("    ", "\t")) and not blank
            code = indented and (code or previous_blank)
            if not code:
                yield i, line
        previous_blank = blank


def code_citations(text: str) -> set[str]:
    """The repository paths (files and folders) that ``text`` cites as backquoted paths or links."""
    found = set()
    for _, line in _prose_lines(text):
        found.update(m.group(1).rstrip(".,;:") for m in BACKQUOTED.finditer(line))
    return found


def code_page(path: str) -> str:
    """The site page (``src_uri``) that shows the repository file or folder ``path``."""
    return f"code/{path.rstrip('/')}/index.md" if path.endswith("/") else f"code/{path}.md"


def link_code(text: str, page: str, exists) -> str:
    """``text`` (the markdown of site page ``page``) with each code citation linked to its code page.

    A backquoted path becomes a link; a relative link to a repository file that is not itself a
    page or an image is pointed at the file's code page. ``exists(path)`` says whether a repository
    path is there (the rest are left alone for ``tests/test_docs.py`` to report)."""
    here = posixpath.dirname(page)
    lines = text.split("\n")

    def to(target: str) -> str:
        return posixpath.relpath(code_page(target), here or ".")

    def backquoted(m: re.Match) -> str:
        path = m.group(1).rstrip(".,;:")
        if not exists(path):
            return m.group(0)
        return f"[{m.group(0)}]({to(path)})"

    def linked(m: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, m.group(2)))
        if target.endswith(NOT_CODE) or not target.startswith(CODE_ROOTS) or not exists(target):
            return m.group(0)
        folder = target + "/" if m.group(2).endswith("/") else target
        return f"{m.group(1)}{to(folder)}{m.group(4)}"

    for i, line in _prose_lines(text):
        lines[i] = BACKQUOTED.sub(backquoted, LINK.sub(linked, line))
    return "\n".join(lines)


def _exists(path: str) -> bool:
    return (ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).is_file()


def _render(path: str, shown: set[str]) -> str:
    """The markdown of the code page of ``path``: the file in a fenced block, or a folder's listing
    (each entry linked when it has a page of its own: it is in ``shown``)."""
    if path.endswith("/"):
        rows = []
        for c in sorted((ROOT / path).iterdir()):
            child = f"{path}{c.name}/" if c.is_dir() else f"{path}{c.name}"
            if c.name.startswith((".", "__pycache__")):
                continue
            name = f"`{c.name}{'/' if c.is_dir() else ''}`"
            here = posixpath.dirname(code_page(path))
            rows.append(f"- [{name}]({posixpath.relpath(code_page(child), here)})" if child in shown
                        else f"- {name}")
        return f"# `{path}`\n\n" + "\n".join(rows) + "\n"
    source = (ROOT / path).read_text(encoding="utf-8")
    fence = "````" if "```" in source else "```"
    language = CODE_SUFFIXES.get(Path(path).suffix, "text")
    return f"# `{path}`\n\n{fence}{language} linenums=\"1\"\n{source}\n{fence}\n"


def _closure(cited: set[str]) -> set[str]:
    """The cited paths plus, for a cited folder, its files and subfolders (one level down)."""
    out = set(cited)
    for path in cited:
        if path.endswith("/") and (ROOT / path).is_dir():
            for c in (ROOT / path).iterdir():
                if c.is_dir() and not c.name.startswith((".", "__")):
                    out.add(f"{path}{c.name}/")
                elif c.is_file() and c.suffix in CODE_SUFFIXES and c.suffix:
                    out.add(f"{path}{c.name}")
    return {p for p in out if _exists(p)}


def on_files(files, config):
    """Add README (the home page), the chapters, their plots and notebooks, and a page per cited code file."""
    from mkdocs.structure.files import File

    own = {f.src_uri: Path(f.abs_src_path) for f in files.documentation_pages()}  # docs_dir's pages
    for uri in PAGES + sorted(p.relative_to(ROOT).as_posix() for g in STATIC for p in ROOT.glob(g)):
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / uri)))
    cited = set()
    for uri, source in [(u, ROOT / u) for u in PAGES] + sorted(own.items()):
        text = source.read_text(encoding="utf-8")
        cited |= {p for p in code_citations(text) if _exists(p)}
        for m in LINK.finditer(text):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(uri), m.group(2)))
            if target.startswith(CODE_ROOTS) and not target.endswith(NOT_CODE) and _exists(target):
                cited.add(target)
            elif m.group(2).endswith("/") and _exists(target + "/"):
                cited.add(target + "/")
    shown = _closure(cited)
    for path in sorted(shown):
        files.append(File.generated(config, code_page(path), content=_render(path, shown)))
    return files


def course_block(markdown: str) -> str:
    """README with its course table (the first table after "## The course") inside
    ``<div class="course">``: docs/pages/stylesheets/course.css keeps its commands whole."""
    head, sep, rest = markdown.partition("\n## The course\n")
    lines = rest.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if not sep or start is None:
        return markdown
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    lines[start:end] = ['<div class="course" markdown="1">', "", *lines[start:end], "", "</div>"]
    return head + sep + "\n".join(lines)


def keep_words(html: str) -> str:
    """In the course table's HTML, each word of a command in a ``<span class="w">`` (course.css: no
    break inside), so a command wraps only between its words -- never at ``--ranks``'s hyphens."""
    def words(m: re.Match) -> str:
        spans = " ".join(f'<span class="w">{w}</span>' for w in m.group(2).split(" "))
        return m.group(1) + spans + m.group(3)

    def table(m: re.Match) -> str:
        return re.sub(r"(<code>)([^<]*)(</code>)", words, m.group(0))
    return re.sub(r'<div class="course">.*?</div>', table, html, flags=re.S)


def on_page_content(html, page, config, files):
    return keep_words(html) if page.file.src_uri == "README.md" else html


def on_page_markdown(markdown, page, config, files):
    """Link each code citation of a chapter or README to its code page. README, the home page, gets
    the whole width (no navigation or contents column) for its course table."""
    uri = page.file.src_uri
    if uri.startswith("code/"):
        return markdown
    if uri == "README.md":
        page.meta["hide"] = ["navigation", "toc"]
        markdown = course_block(markdown.replace("<details>", '<details markdown="1">'))
    return link_code(markdown, uri, _exists)
