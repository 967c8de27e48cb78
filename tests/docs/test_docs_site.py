"""The documentation site: mkdocs (Material + mkdocstrings) builds in strict mode.

Strict mode turns every warning into a failure: a broken link or anchor, a page missing from
the nav or a nav entry without a page, a docstring mkdocstrings cannot parse. The build tests
skip when the ``docs`` packages are not installed; the checks on the pages' text always run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import trainloop
from trainloop.cli import _build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
CONFIG = REPO / "mkdocs.yml"


def _load_config() -> dict:
    # The config holds a !!python/name tag (the mermaid fence's formatter): load it without
    # importing anything, just to read the nav.
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: suffix)
    return yaml.load(CONFIG.read_text(), Loader=Loader)


def _nav_pages() -> list[str]:
    return [next(iter(entry.values())) for entry in _load_config()["nav"]]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        capture_output=True, text=True, check=False, cwd=config.parent,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = _build(CONFIG, out)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    assert "WARNING" not in result.stderr, result.stderr
    return out


# -- the built site ------------------------------------------------------------------------------


def test_every_nav_page_is_built(site):
    for page in _nav_pages():
        built = site / ("index.html" if page == "index.md" else f"{page.removesuffix('.md')}/index.html")
        assert built.is_file(), f"{page} was not built"


def test_the_machine_diagram_is_a_mermaid_block_material_renders(site):
    html = (site / "machine" / "index.html").read_text()
    # superfences' custom fence: Material finds <pre class="mermaid"> and loads Mermaid for it.
    block = re.search(r'<pre class="mermaid"><code>(.*?)</code></pre>', html, re.S)
    assert block is not None, "no mermaid block on the machine page"
    assert block.group(1).startswith("stateDiagram-v2")
    assert "idle --&gt; building: start" in block.group(1)
    # The picture a reader sees without Mermaid's script: the pre-rendered SVG, shipped with the site.
    assert 'src="../img/machine.svg"' in html
    assert (site / "img" / "machine.svg").is_file()
    assert (site / "img" / "report.png").is_file()
    assert 'src="../img/report.png"' in (site / "results" / "index.html").read_text()


def test_the_api_reference_renders_the_public_objects(site):
    html = (site / "api" / "index.html").read_text()
    for anchor in (
        "trainloop.trainer.BaseTrainer",
        "trainloop.trainer.BaseTrainer.train",
        "trainloop.settings.model.TrainerSettings",
        "trainloop.machine.table.State",
        "trainloop.hooks.checkpointing.CheckpointingHook",
        "trainloop.hook_machinery.registry.register_hook",
        "trainloop.lr_find.search.LrFindComponents",
        "trainloop.cli.main",
        "trainloop.checkpoint.read_checkpoint",
    ):
        assert f'id="{anchor}"' in html, f"{anchor} is not documented"
    # Google sections became parameter tables, not literal "Args:" text.
    assert "Args:" not in html
    # Private helpers stay out.
    assert 'id="trainloop.cli._build_parser"' not in html


def test_a_broken_link_fails_the_strict_build(tmp_path):
    copy = tmp_path / "project"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(CONFIG, copy / "mkdocs.yml")
    index = copy / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](no_such_page.md).\n")
    result = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "contains a link 'no_such_page.md'" in result.stderr, result.stderr


# -- the pages' text (no mkdocs needed) ----------------------------------------------------------


def test_nav_lists_every_page_and_every_page_exists():
    pages = _nav_pages()
    assert pages[0] == "index.md"
    on_disk = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(pages) == on_disk
    for page in ("checkpointing.md", "cli.md", "benchmarks.md", "api.md"):
        assert page in pages


def test_the_overview_lists_every_page():
    # Issue 32: docs/index.md's page list missed six pages.
    pages = (DOCS / "index.md").read_text().split("## Pages\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \[[^\]]+\]\((\w+\.md)\)", pages, re.M)
    assert sorted(listed) == sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert listed == [page for page in _nav_pages() if page != "index.md"]  # in the nav's order


def test_api_page_links_every_top_level_export():
    text = (DOCS / "api.md").read_text()
    linked = set(re.findall(r"\[`(\w+)`\]\[trainloop\.", text))
    assert linked == set(trainloop.__all__), (
        f"missing from api.md: {sorted(set(trainloop.__all__) - linked)}; "
        f"not exported: {sorted(linked - set(trainloop.__all__))}"
    )


def test_api_page_documents_every_hook_module():
    text = (DOCS / "api.md").read_text()
    modules = sorted(
        p.stem for p in (REPO / "trainloop" / "hooks").glob("*.py") if p.stem != "__init__" and not p.stem.startswith("_")
    )
    missing = [m for m in modules if f"::: trainloop.hooks.{m}\n" not in text]
    assert not missing, f"hook modules without an API entry: {missing}"


def test_cli_page_covers_every_subcommand_and_exit_code():
    text = (DOCS / "cli.md").read_text()
    parser = _build_parser()
    subcommands = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices
    for name in subcommands:
        assert f"## `trainloop {name}`" in text, f"docs/cli.md has no section for `trainloop {name}`"
    table = text.split("## Exit codes", 1)[1]
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 128 + N |"):
        assert code in table
