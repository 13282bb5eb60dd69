"""The documentation a newcomer reads: README.md stays a first page (STYLE.md: ~12 KB), every relative link of
the hand-written pages leads to a file (and a heading) that exists, and the one config README.md shows loads."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_BYTES = 12_500
PAGES = sorted([README, *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md"), ROOT / "examples" / "README.md"])
# Written by the config package's generator (`python -m trainer.config.docs`), from the schema's docstrings and the
# alias table; a branch that only writes the hand-written pages may not have them yet, so a link to one of them is
# accepted while it is absent. Once present, they are checked like any other page.
GENERATED = {ROOT / "docs" / "config.md", ROOT / "docs" / "verl.md"}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a `[x](y)` inside one is code, not a link)."""
    return FENCE.sub("", page.read_text(encoding="utf-8"))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (code spans' backticks too), spaces to
    hyphens; letters of any script are kept."""
    kept = "".join(char for char in heading.lower()
                   if char in " -_" or unicodedata.category(char)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(heading) for heading in HEADING.findall(prose(page))}


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: ... leave the repository


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in relative_links(page):
        path_part, _, fragment = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            if destination not in GENERATED:
                broken.append(f"{target}: no such file")
            continue
        if fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target}: no such heading")
    return broken


def test_the_readme_is_a_first_page_not_a_manual() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: move reference to docs/ "
                                      "and dated figures to benchmarks/ (STYLE.md)")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    assert page.exists()
    assert broken_links(page) == []


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in relative_links(README)}
    pages = {path.resolve() for path in ROOT.glob("docs/*.md")} | GENERATED
    assert sorted(str(page.relative_to(ROOT)) for page in pages - linked) == []
    assert (ROOT / "benchmarks" / "README.md").resolve() in linked


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Live settings: `verl set`\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[a](other.md#live-settings-verl-set) [b](missing.md) [c](other.md#nowhere) [d](#other)\n"
                    "[e](https://example.com/x.md)\n```\n[f](in-code.md)\n```\n# Other\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no such heading"]


def test_the_readmes_annotated_config_loads(tmp_path: Path) -> None:
    """The config README.md walks through, line by line, is a valid run (on the built-in model and task)."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", README.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1, "README.md shows one annotated config"
    config_file = tmp_path / "run.yaml"
    config_file.write_text(blocks[0], encoding="utf-8")
    config = load_config(config_file, [f"trainer.runs_dir={tmp_path}"])
    actor = config.actor_rollout_ref.actor.fsdp_config
    assert actor.param_offload and actor.optimizer_offload and actor.dynamic_offload.enabled
    assert actor.placement("lm_head") == "gpu" and actor.placement("transformer") == "cpu"
    every_line = [line for line in blocks[0].splitlines() if line.strip()]
    assert all("#" in line for line in every_line if not line.rstrip().endswith(":")), \
        "every line that sets a value says what it does"
