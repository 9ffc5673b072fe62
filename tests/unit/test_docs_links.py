"""Every relative link in the README and docs/ points at a file that exists, and a link to a section
(``page.md#anchor``, ``#anchor``) at a heading that exists in that page, by GitHub's anchor rules; so
does a section named in prose (``(README, "Streaming episodes")``). Paths of the repository named in
backticks (`examples/run_grpo_math.py`, `nemo_like/cli.py`) exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
# A backticked path of ours: a top-level folder of the repository, then a file or folder name.
REPO_PATH = re.compile(r"`((?:examples|nemo_like|tests|docs|notebooks|benchmarks)/[\w./-]*\w/?)`")
# A section named in prose: (README, "Streaming episodes"), benchmarks/README.md, "On a lent GPU".
SECTION_REF = re.compile(r"\b(README|[\w./-]+\.md),? \"([^\"]{3,80})\"")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str):
    """(line number, line) of ``text`` outside fenced code blocks."""
    fenced = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield lineno, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (links by their words) lower-cased, punctuation other than
    '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors ``page`` has: one per heading (a repeated one gets -1, -2, ...) and HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(page.read_text()):
        found |= set(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_slugs_are_githubs():
    assert slug("Streaming episodes") == "streaming-episodes"
    assert slug("From a notebook: `GRPOExperiment`") == "from-a-notebook-grpoexperiment"
    assert slug("Reasoning gym: a hundred task generators, with their own graders") == \
        "reasoning-gym-a-hundred-task-generators-with-their-own-graders"
    assert slug("Balanced batches over two workers (bench_balance.py)") == \
        "balanced-batches-over-two-workers-bench_balancepy"
    assert slug("See [the guide](x.md) first") == "see-the-guide-first"


def test_relative_links_resolve():
    broken = []
    for page in pages():
        for lineno, line in prose_lines(page.read_text()):
            for target in LINK.findall(line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                file, _, anchor = target.partition("#")
                path = (page.parent / file).resolve() if file else page
                where = f"{page.relative_to(ROOT)}:{lineno}: {target}"
                if not path.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    broken.append(f"{where} (no heading with that anchor in {path.relative_to(ROOT)})")
    assert not broken, "\n".join(broken)
    assert len(pages()) >= 3


def test_repository_paths_named_in_backticks_exist():
    missing = []
    for page in pages():
        if page.name == "CHANGELOG.md":  # history: it may name files that were renamed since
            continue
        for lineno, line in enumerate(page.read_text().splitlines(), start=1):
            for path in REPO_PATH.findall(line):
                if "*" not in path and "<" not in path and not (ROOT / path).exists():
                    missing.append(f"{page.relative_to(ROOT)}:{lineno}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_sections_named_in_prose_exist():
    missing = []
    for page in pages():
        if page.name == "CHANGELOG.md":
            continue
        for lineno, line in enumerate(page.read_text().splitlines(), start=1):
            for name, title in SECTION_REF.findall(line):
                target = ROOT / "README.md" if name == "README" else next(
                    (p for p in (ROOT / name, page.parent / name) if p.exists()), None)
                # Prose may shorten a heading ("On a lent GPU" for "On a lent GPU (`device/`)").
                if target is None or not any(a.startswith(slug(title)) for a in anchors(target)):
                    missing.append(f"{page.relative_to(ROOT)}:{lineno}: {name}, \"{title}\"")
    assert not missing, "sections that do not exist:\n" + "\n".join(missing)


def test_every_exit_code_of_the_cli_is_documented():
    """The exit codes the CLI scripts return (nemo_like/cli.py, examples/*.py) are rows of the table in
    docs/getting_started.md."""
    sources = [ROOT / "nemo_like" / "cli.py", *sorted((ROOT / "examples").glob("*.py"))]
    codes = {int(c) for src in sources for c in re.findall(r"^\s+return (\d+)\s*$", src.read_text(), re.M)}
    documented = {int(c) for c in re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "getting_started.md").read_text(), re.M)}
    assert {0, 1, 2, 3, 4} <= codes
    assert codes <= documented, f"exit codes missing from docs/getting_started.md: {sorted(codes - documented)}"
