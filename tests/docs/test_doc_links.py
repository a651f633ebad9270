"""Every relative link in the docs resolves: README.md, docs/*.md, bench/README.md and the client's README. A link
to a file must name one that exists; a ``#anchor`` must be a heading of its page (GitHub's slugs) or an explicit
``<a id>``. Links inside code (fenced blocks, inline spans) and to other sites are not checked."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
from support.paths import ROOT

PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "clients" / "python" / "README.md",
                *(ROOT / "docs").glob("*.md")])  # fmt: skip
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (headings keep their span's content)."""
    return CODE_SPAN.sub(" ", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for _, title in HEADING.findall(text):
        base = slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return frozenset(out)


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", target)]


def test_the_slugs_are_githubs() -> None:
    assert slug("Adapters from a Hugging Face cache (`hf://`)") == "adapters-from-a-hugging-face-cache-hf"
    assert slug("Loading: what the numbers say") == "loading-what-the-numbers-say"
    assert slug("One thread runs parallel kernels (`service/torch_threads.py`)") == (
        "one-thread-runs-parallel-kernels-servicetorch_threadspy"
    )


def test_the_pages_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "bench/README.md", "docs/flags.md", "docs/operations.md"} <= names
    assert links(ROOT / "README.md"), "the README links its docs"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not a page")
    assert not broken, "\n".join(broken)


def test_the_readme_indexes_every_page_and_every_top_level_folder() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is the front page: reference material belongs in docs/"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name})" in readme, f"docs/{page.name} is not in README.md's docs index"
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    folders = {Path(name).parts[0] for name in tracked.splitlines() if len(Path(name).parts) > 1}
    layout = readme[readme.index("## Layout") :]
    for folder in sorted(folders):
        assert f"| `{folder}/" in layout, f"{folder}/ is missing from README.md's layout table"
