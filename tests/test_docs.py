"""The documentation site and the README's shape (issue 35).

`mkdocs build --strict` must pass (a broken link, anchor or reference fails it), the API
reference must hold every public name of the four public modules, the server page's table
must hold every sampling field the server accepts, and the README stays a front door: short,
an example early, and speed ratios only in its one performance table. The examples
themselves run in test_readme.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MODULES = ("decodekit", "decodekit.meta", "decodekit.align", "decodekit.compress")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for tool in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(tool, reason="the dev extra installs the documentation tools")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's banner
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return out


def hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def defined_at(module, name: str) -> str:
    value = getattr(module, name)
    if inspect.ismodule(value):  # decodekit.meta's lazily resolved names (hooks.definition)
        value = getattr(value, name)
    return f"{value.__module__}.{value.__qualname__}"


def test_every_public_name_is_in_the_api_reference(site):
    page = (site / "api" / "index.html").read_text()
    missing = [f"{name}.{attr}" for name in MODULES for attr in importlib.import_module(name).__all__
               if f'id="{defined_at(importlib.import_module(name), attr)}"' not in page]
    assert not missing, f"not in the API reference: {missing}"


def test_the_server_page_lists_every_sampling_field(site):
    from decodekit.server.extensions import EXTENSIONS, RENAMED, allowed

    page = (site / "server" / "index.html").read_text()
    for name in (*EXTENSIONS, *RENAMED):
        row = re.search(rf"<td><code>{name}</code></td>\s*<td>(.*?)</td>", page)
        assert row, name
        assert row.group(1).replace("&gt;", ">").replace("&lt;", "<") == allowed(name)


def test_every_page_is_in_the_navigation(site):
    nav = (site / "index.html").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f'href="{page.stem}/"' in nav, page.name


def test_links_become_site_links():
    """A page's repository links, as the site's: root files by their page, docs/ pages by
    their name, anything else as its path in code."""
    h = hooks()
    page = "see [the log](../BENCHMARKS-archive.md#threads) and [raw](../benchmarks/results/kv.json)"
    assert h.rewrite_links(page, "docs") == ("see [the log](benchmarks-archive.md#threads) and "
                                             "raw (`benchmarks/results/kv.json`)")
    root = "[decoding](docs/decoding.md#beam-search), ![plot](docs/img/meta_arith.png), [x](https://a.b)"
    assert h.rewrite_links(root, "") == ("[decoding](decoding.md#beam-search), "
                                         "![plot](img/meta_arith.png), [x](https://a.b)")
    assert h.rewrite_links("```\n[c](d.md)\n```", "docs") == "```\n[c](d.md)\n```"  # code stays


def readme_sections() -> dict[str, str]:
    text = README.read_text()
    parts = re.split(r"^## ", text, flags=re.MULTILINE)
    return {part.split("\n", 1)[0]: part for part in parts[1:]}


def test_the_readme_is_a_front_door():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250 and len(text.split()) <= 2000
    first_example = next(i for i, line in enumerate(lines, start=1) if line == "```python")
    assert first_example <= 60
    # Speed ratios (1.5x, 0.9×) only in the one performance table.
    ratio = re.compile(r"\b\d+(\.\d+)?(-\d+(\.\d+)?)?\s?[x×](?![\w])")
    outside = {name: ratio.findall(body) for name, body in readme_sections().items() if name != "Performance"}
    assert not any(outside.values()) and not ratio.search(text.split("\n## ", 1)[0]), outside
    assert "BENCHMARKS.md" in readme_sections()["Performance"]


def test_every_algorithm_links_to_its_page():
    """Each row of the README's algorithm table links to a docs page that exists, and to an
    anchor that page has (GitHub's and MkDocs' slugs agree for these headings)."""
    table = readme_sections()["Every algorithm"]
    links = re.findall(r"\]\((docs/[\w-]+\.md)(?:#([\w-]+))?\)", table)
    assert len(links) >= 15
    for path, anchor in links:
        page = ROOT / path
        assert page.exists(), path
        if anchor:
            headings = [re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-")
                        for h in re.findall(r"^#+ (.*)$", page.read_text(), flags=re.MULTILINE)]
            assert anchor in headings, (path, anchor)


def test_benchmarks_opens_with_where_things_stand():
    text = (ROOT / "BENCHMARKS.md").read_text()
    head = text.split("\n## Logs since the archive", 1)[0]
    assert head.splitlines()[2] == "## Where things stand" and len(head.splitlines()) <= 150
    assert "(BENCHMARKS-archive.md)" in head and (ROOT / "BENCHMARKS-archive.md").exists()
    assert "### On a GPU" in head  # said, even while nothing is measured there
