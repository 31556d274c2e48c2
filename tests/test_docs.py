"""The manual stays true to the code: the configuration reference is the generator's output and
holds every key the shipped configs set and every settings record the code reads; links resolve."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from infmem_verl import conf_dir
from infmem_verl.config_reference import COMPONENTS, SECTIONS, documented_keys, markdown

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "configuration.md"
REGENERATE = "python -m infmem_verl.config_reference > docs/configuration.md"


def test_the_configuration_reference_is_the_generators_output():
    assert REFERENCE.read_text() == markdown(), f"docs/configuration.md is out of date: run `{REGENERATE}`"


def _leaves(node, prefix: str):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}.{key}")
    else:
        yield prefix


def test_every_infmem_key_of_a_shipped_config_is_in_the_reference():
    documented = documented_keys()
    missing = {}
    for path in sorted(conf_dir().rglob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path)).get("infmem")
        for key in _leaves(node, "infmem") if node else ():
            parts = key.split(".")
            section = any(d.startswith(f"{key}.") for d in documented)  # a null section (`bootstrap: null`)
            if not section and not any(".".join(parts[:n]) in documented for n in range(2, len(parts) + 1)):
                missing.setdefault(key, path.relative_to(conf_dir()).as_posix())
    assert not missing, f"keys without a row in docs/configuration.md (add the section to SECTIONS, then `{REGENERATE}`): {missing}"
    assert f"{COMPONENTS}.early_stop.gamma" in documented and "infmem.agent.retrieval.k1" in documented


def test_every_settings_record_the_code_reads_is_a_section_of_the_reference():
    """A new ``read_settings(NewSettings, config, "infmem.x")`` fails here until it is listed."""
    read = set()
    for path in (REPO / "infmem_verl").rglob("*.py"):
        read.update(re.findall(r"read_settings\((\w+),", path.read_text()))
    read.discard("cls")  # the helper's own signature
    assert read <= {section.record.__name__ for section in SECTIONS}, read


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    headings = re.findall(r"^#+ (.*)$", page.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_in_the_readme_and_the_manual_resolve():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            file = page.parent / target if target else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert not broken, broken
