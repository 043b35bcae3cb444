"""The README and the documentation site cannot rot: their Python examples run, every error class has its
troubleshooting entry, the README stays a front door, and the site builds with ``mkdocs build --strict``.

A ```python block runs as written, in a fresh namespace of this process, unless the line right before it is
a marker comment (invisible on the rendered page)::

    <!-- docs-test: skip (why: needs 8 GPUs, a fragment of the page's other code, ...) -->
    <!-- docs-test: own-process -->   # the block starts ranks (Trainer(devices=N).fit): run as a script

Blocks that are the same code on several pages run once. Every block that runs is CPU-sized.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
FIRST_SCREEN_LINES = 40  # a terminal or a repository page shows about this much before the reader scrolls

MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>skip|own-process)\s*(?P<reason>\(.*\))?\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "skip", "own-process" or None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, each with the docs-test marker on the line before it."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.relative_to(ROOT)}:{i + 1}: a code block is never closed"
        marker = MARKER.search(lines[i - 1]) if i > 0 else None
        blocks.append(Block(page, i + 1, fence["lang"], "\n".join(lines[i + 1:end]) + "\n",
                            marker["kind"] if marker else None, marker["reason"] if marker else None))
        i = end + 1
    return blocks


def python_blocks() -> list[Block]:
    """Every ```python block of the README and docs/, the first of identical ones only."""
    seen, unique = set(), []
    for page in PAGES:
        for block in code_blocks(page):
            if block.lang == "python" and block.code not in seen:
                seen.add(block.code)
                unique.append(block)
    return unique


BLOCKS = python_blocks()


def run_in_process(block: Block) -> None:
    namespace = {"__name__": f"docs_example_{block.page.stem}_{block.line}"}
    exec(compile(block.code, block.where, "exec"), namespace)


def run_as_script(block: Block, tmp_path: Path) -> None:
    # Lightning's launcher starts the other ranks by running the script again, so the block must be a file.
    script = tmp_path / f"example_{block.page.stem}_{block.line}.py"
    script.write_text(block.code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{block.where} exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_python_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.marker == "skip":
        assert block.reason, f"{block.where}: a skipped example says why: <!-- docs-test: skip (why) -->"
        pytest.skip(f"{block.where} {block.reason}")
    monkeypatch.chdir(tmp_path)  # lightning_logs/ and checkpoints land here, not in the repository
    if block.marker == "own-process":
        run_as_script(block, tmp_path)
    else:
        run_in_process(block)


def test_every_page_has_its_examples_found() -> None:
    """The extractor sees the pages' examples (a renamed fence or folder would silently leave nothing to run)."""
    assert len(BLOCKS) >= 6, [b.where for b in BLOCKS]
    assert any(b.page.name == "README.md" and b.marker == "own-process" for b in BLOCKS)


def test_every_error_class_has_a_troubleshooting_entry() -> None:
    from lightning_3d import errors

    classes = [name for name, obj in inspect.getmembers(errors, inspect.isclass)
               if issubclass(obj, BaseException) and obj.__module__ == errors.__name__]
    assert classes, "lightning_3d.errors defines no error class"
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = set(re.findall(r"^## `(\w+)`", page, flags=re.MULTILINE))
    missing = [name for name in classes if name not in headings]
    assert not missing, f"docs/troubleshooting.md has no '## `Name`' entry (cause and fix) for {missing}"
    for name in classes:
        entry = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        assert "**Cause**" in entry and "**Fix**" in entry, f"the entry for {name} gives its cause and its fix"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference material into docs/")
    first_screen = "\n".join(lines[:FIRST_SCREEN_LINES])
    for command in ("pip install torch==2.13.0", "lightning-3d fit --config", "python -m pytest tests"):
        assert command in first_screen, f"{command!r} is not on the README's first screen ({FIRST_SCREEN_LINES} lines)"


def test_readme_links_reach_existing_pages() -> None:
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]+)?\)", text):
        assert (ROOT / target).is_file(), f"README.md links to {target}, which does not exist"


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
    pytest.importorskip("mkdocstrings")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def test_changelog_names_the_package_version() -> None:
    import lightning_3d

    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", text, flags=re.MULTILINE)
    assert versions, "CHANGELOG.md has no released version (## [X.Y.Z] - date)"
    assert versions[0] == lightning_3d.__version__, (
        f"CHANGELOG.md's newest version is {versions[0]}, lightning_3d.__version__ is {lightning_3d.__version__}")
