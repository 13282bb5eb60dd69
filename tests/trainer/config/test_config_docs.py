"""docs/config.md and docs/verl.md are written from the schema and the alias table (trainer/config/docs.py):
a page that differs from what the generator writes now is stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import REPO
from trainer.config.aliases import ALIASES
from trainer.config.docs import COMMAND, HEADER, config_page, pages, verl_page
from trainer.config.keys import leaf_keys


@pytest.mark.parametrize(("path", "text"), list(pages()), ids=lambda value: getattr(value, "name", ""))
def test_the_generated_page_is_current(path: Path, text: str) -> None:
    assert path.is_file(), f"{path.relative_to(REPO)} is missing: run `{COMMAND}`"
    assert path.read_text(encoding="utf-8") == text, f"{path.relative_to(REPO)} is stale: run `{COMMAND}`"


def test_each_page_says_how_it_is_made_in_its_first_line() -> None:
    for _, text in pages():
        assert text.splitlines()[0] == HEADER and COMMAND in HEADER and "do not edit" in HEADER


def test_the_config_page_names_every_key_or_the_section_whose_keys_it_shares() -> None:
    page = config_page()
    missing = [key for key in leaf_keys() if f"`{key}`" not in page
               and not any(f"under `{prefix}`." in page for prefix in _prefixes(key))]
    assert missing == []


def test_a_section_shared_by_the_models_is_written_once() -> None:
    page = config_page()
    assert "`critic.fsdp_config.param_offload`" not in page
    assert "under `critic.fsdp_config`." in page and "`actor_rollout_ref.actor.fsdp_config.param_offload`" in page
    assert "| `critic.optim.lr` | a number > 0 | `1e-05` |" in page, "the critic's own default, not the actor's"


def test_the_verl_page_has_every_entry_of_the_alias_table() -> None:
    page = verl_page()
    assert all(f"| `{alias.written}` |" in page and alias.why.replace("|", "\\|") in page for alias in ALIASES)


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:length]) for length in range(1, len(parts))]
