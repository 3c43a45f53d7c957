"""MkDocs hooks of decodekit's documentation site (mkdocs.yml names this file).

The Markdown files stay readable where they are (on a forge, in an editor), so their links
are repository paths: a page under docs/ links `../BENCHMARKS.md`, a root file links
`docs/decoding.md`. This hook makes one site of them:

- the root files README.md (the home page), BENCHMARKS.md and its archive, MODELS.md and
  REFERENCES.md become generated pages, their links rewritten to the site's pages; a link to
  a repository file that is not a page (a script, a JSON result) becomes its path in code;
- docs/server.md's table of the sampling fields is generated from SamplingParams' fields,
  `params.RANGES` and `params.DESCRIPTIONS` (as the server's OpenAPI document is), and the
  build fails when a request field of the server has no line on that page;
- docs/api.md's entries are generated from the `__all__` of the public modules, one
  mkdocstrings directive per name at the path where it is defined (the packages resolve
  their names lazily, which static analysis cannot follow).
"""

from __future__ import annotations

import importlib
import json
import posixpath
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
# Root file -> its page on the site.
ROOT_PAGES = {
    "README.md": "index.md",
    "BENCHMARKS.md": "benchmarks.md",
    "BENCHMARKS-archive.md": "benchmarks-archive.md",
    "MODELS.md": "models-trained.md",
    "REFERENCES.md": "references.md",
}
API_MODULES = ("decodekit", "decodekit.meta", "decodekit.align", "decodekit.compress")
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def on_config(config):
    # The API entries and the field table import decodekit: this checkout's, not another one.
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return config


def on_files(files, config):
    for source, page in ROOT_PAGES.items():
        files.append(File.generated(config, page, content=(ROOT / source).read_text()))
    return files


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    # Where the page's Markdown lives in the repository, for resolving its relative links.
    origin = next((name for name, uri in ROOT_PAGES.items() if uri == src), None)
    directory = "" if origin else posixpath.dirname(posixpath.join("docs", src))
    markdown = rewrite_links(markdown, directory)
    if src == "server.md":
        markdown = replace_between(markdown, "sampling-fields", sampling_fields_table())
        check_request_fields(markdown)
    if src == "api.md":
        markdown = replace_between(markdown, "api-reference", api_reference())
    return markdown


def rewrite_links(markdown: str, directory: str) -> str:
    """Each relative link of a page whose source sits in `directory` (a repository path),
    as a link between the site's pages, or as code naming a repository file."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(lambda m: site_link(m, directory), line))
    return "\n".join(out)


def site_link(match: re.Match, directory: str) -> str:
    text, target = match.groups()
    if re.match(r"^[a-z]+:|^#", target):
        return match.group(0)  # a URL, or an anchor of the same page
    path, _, anchor = target.partition("#")
    resolved = posixpath.normpath(posixpath.join(directory, path))
    if resolved in ROOT_PAGES:
        page = ROOT_PAGES[resolved]
    elif resolved.startswith("docs/"):
        page = resolved.removeprefix("docs/")
    else:
        # A repository file the site does not hold: name it (an image keeps its words).
        return f"{text[2:-1]} (`{resolved}`)" if text.startswith("!") else f"{text[1:-1]} (`{resolved}`)"
    return f"{text}({page}{'#' + anchor if anchor else ''})"


def replace_between(markdown: str, marker: str, content: str) -> str:
    pattern = re.compile(rf"<!-- {marker} -->.*?<!-- /{marker} -->", flags=re.DOTALL)
    if not pattern.search(markdown):
        raise PluginError(f"the page has no <!-- {marker} --> ... <!-- /{marker} --> block")
    return pattern.sub(lambda _: content, markdown)


def sampling_fields_table() -> str:
    """The server's sampling fields (server/extensions.py), each with its type and range, its
    default and its description, from the code the server validates requests with."""
    from decodekit.params import DESCRIPTIONS, SamplingParams
    from decodekit.server.extensions import EXTENSIONS, RENAMED, allowed, sampling_name

    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                for f in fields(SamplingParams)}
    rows = ["| field | allowed | default | what it does |", "|---|---|---|---|"]
    for name in (*EXTENSIONS, *RENAMED):
        sampled = sampling_name(name)
        default = defaults[sampled]
        shown = json.dumps(list(default) if isinstance(default, tuple) else default).replace("|", "\\|")
        what = DESCRIPTIONS[sampled] + (f" (vLLM's name for `{sampled}`)" if name != sampled else "")
        limits = allowed(name).replace("|", "\\|")
        rows.append(f"| `{name}` | {limits} | `{shown}` | {what} |")
    return "\n".join(rows)


def check_request_fields(markdown: str) -> None:
    """Every field a request body may carry is named on the server page."""
    from decodekit.server import protocol

    names = set(protocol.CompletionRequest.model_fields) | set(protocol.ChatRequest.model_fields)
    missing = sorted(name for name in names if f"`{name}`" not in markdown)
    if missing:
        raise PluginError(f"docs/server.md does not describe the request fields {missing}")


def api_reference() -> str:
    sections = []
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        entries = [f"## `{module_name}`"]
        for name in module.__all__:
            entries.append(f"::: {definition(module, name)}")
        sections.append("\n\n".join(entries))
    return "\n\n".join(sections)


def definition(module, name: str) -> str:
    """The dotted path where `module.name` is defined."""
    value = getattr(module, name)
    where = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not where or not qualname:
        raise PluginError(f"{module.__name__}.{name} has no __module__/__qualname__ to document")
    return f"{where}.{qualname}"
