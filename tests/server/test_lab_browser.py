"""The lab page in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
loads /lab on the embedded models, runs each view and checks what it shows.

Skipped without playwright or a Chromium binary (scripts/setup.sh dev installs both when it
can). Screenshots go to a temporary directory, or to $DECODEKIT_LAB_SCREENSHOTS (docs/lab.md's
are made with DECODEKIT_LAB_SCREENSHOTS=docs/img).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary (apt-get install chromium)")


@pytest.fixture(scope="module")
def lab():
    """(browser, url): headless Chromium and a server on the embedded shakespeare model."""
    import torch

    from decodekit.server.app import ServerThread, load_models
    from decodekit.server.backend import Backend, ServerConfig

    torch.set_num_threads(1)
    backend = Backend(load_models(["shakespeare"]), ServerConfig(kv_bytes=16 * 2**20))
    with ServerThread(backend) as server, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser, server.url
        browser.close()


def open_lab(lab, width: int = 1366, height: int = 860):
    """A new page on /lab, loaded (its first view has run with its defaults)."""
    browser, url = lab
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(60_000)
    page.goto(url + "/lab")
    page.wait_for_selector("body[data-ready=true]")
    return page


@pytest.fixture(scope="module")
def page(lab):
    page = open_lab(lab)
    yield page
    page.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("DECODEKIT_LAB_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("lab-shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_view(page, button: str, drawn: str) -> None:
    """Click a view's run button and wait for its answer drawn (the page opens with the sampler's
    output already there: waiting for `drawn` alone could read the one before)."""
    page.click(button)  # sets the output's aria-busy until the answer is drawn
    page.wait_for_selector(".out[aria-busy]", state="detached")
    page.wait_for_selector(drawn)


def kept(page, stage: str) -> int:
    return page.locator(f"#sampler-tokens td.kept[data-stage={stage}]").count()


def test_sampler_view_shows_what_top_k_removes(page, shots):
    page.fill("#chain li[data-adapter=top_k] input", "5")
    page.fill("#chain li[data-adapter=temperature] input", "0.8")
    run_view(page, "#sampler-run", "#sampler-tokens")
    assert kept(page, "top_k") == 5 < kept(page, "raw")
    assert page.locator("#sampler-tokens td.removed-here[data-stage=top_k]").count() > 0
    page.click("#sampler-sample")  # one step: a token is drawn and the next position shown
    page.wait_for_function("document.querySelector('#sampler-generated').textContent.length > 0")
    page.locator("#sampler-tokens button.token:not([disabled])").first.click()  # pick one by clicking
    page.wait_for_function("document.querySelector('.note') && "
                           "document.querySelector('#sampler-generated').textContent.length > 1")
    assert page.locator("#error").is_hidden()
    page.screenshot(path=shots / "lab-sampler.png", full_page=True)
    page.select_option("#preset", "creative-writing")  # seed 003's row: T 0.7, top-p 0.8
    assert page.input_value("#chain li[data-adapter=temperature] input") == "0.7"
    assert page.input_value("#chain li[data-adapter=top_p] input") == "0.8"


def test_beam_and_tree_views_draw_trees(page, shots):
    page.click("#tab-beam")
    page.fill("#beam-form [name=max_new_tokens]", "4")
    run_view(page, "#beam-run", "#beam-out svg.tree")
    assert page.locator("#beam-out g.node.chosen").count() >= 5  # the prompt and 4 tokens
    assert page.locator("#beam-out g.node.pruned").count() > 0
    page.select_option("#tree-form [name=method]", "rebase")
    run_view(page, "#tree-run", "#tree-out svg.tree")
    assert page.locator("#tree-out g.node.chosen").count() >= 2
    assert "generator calls" in page.inner_text("#tree-out .budget")
    page.screenshot(path=shots / "lab-beam.png", full_page=True)


def test_speculative_view_accepts_draft_tokens_at_temperature_0(page, shots):
    page.click("#tab-speculative")
    page.fill("#speculative-form [name=temperature]", "0")
    run_view(page, "#speculative-run", "#speculative-blocks")
    assert page.locator("#speculative-blocks .chip.accepted").count() >= 1
    assert int(page.inner_text("td.accepted-total[data-rule=block]")) >= 1
    page.screenshot(path=shots / "lab-speculative.png", full_page=True)


def test_votes_view_shows_each_rule_pick(page, shots):
    page.click("#tab-votes")
    run_view(page, "#votes-run", "#votes-samples")
    assert page.locator("#votes-samples tbody tr").count() == 8
    for rule in ("majority", "weighted", "best_of_n"):
        assert "answer" in page.inner_text(f".picks [data-rule={rule}]")
    with page.expect_download() as download:  # every view exports what it shows
        page.click("#view-votes button.export")
    assert download.value.suggested_filename == "decodekit-lab-votes.json"
    page.screenshot(path=shots / "lab-votes.png", full_page=True)


def test_views_are_reachable_by_keyboard(page):
    page.focus("#tab-sampler")
    page.keyboard.press("ArrowRight")  # the tab list: arrows move between views
    assert page.evaluate("document.activeElement.id") == "tab-beam"
    assert page.is_visible("#view-beam") and page.is_hidden("#view-sampler")
    page.keyboard.press("Tab")  # into the view's first control, which has a label
    label = page.evaluate("document.activeElement.closest('label').textContent")
    assert label.startswith("Model")
    page.focus("#tab-beam")
    page.keyboard.press("ArrowLeft")
    assert page.is_visible("#view-sampler")


def test_sampler_view_opens_with_an_active_chain(lab):
    page = open_lab(lab)  # nothing clicked: the page has run the chain with its defaults
    stages = page.locator("#sampler-out table.stages tbody tr")
    names = [stages.nth(i).locator("th").inner_text() for i in range(stages.count())]
    assert names[0] == "raw" and len(names) >= 2, names  # at least one adapter ran
    active = page.eval_on_selector_all("#chain li.active", "items => items.map((i) => i.dataset.adapter)")
    assert active == names[1:]  # the editor marks the stages the distribution went through
    removed = [int(stages.nth(i).locator("td").nth(2).inner_text()) for i in range(1, len(names))]
    assert sum(removed) > 0  # and they changed it: top_p 0.95 drops the tail
    page.close()


def in_view(page, selector: str, frame: str) -> list[str]:
    """Elements matching `selector` not wholly inside the viewport and `frame`'s box."""
    return page.evaluate("""([selector, frame]) => {
      const outer = document.querySelector(frame).getBoundingClientRect();
      const view = { left: 0, top: 0, right: innerWidth, bottom: innerHeight };
      const inside = (r, box) => r.left >= box.left - 0.5 && r.right <= box.right + 0.5 &&
        r.top >= box.top - 0.5 && r.bottom <= box.bottom + 0.5;
      return [...document.querySelectorAll(selector)].map((e) => [e, e.getBoundingClientRect()])
        .filter(([, r]) => !inside(r, outer) || !inside(r, view))
        .map(([e, r]) => `${e.textContent.trim().slice(0, 30)} at ` +
          `${r.left},${r.top}..${r.right},${r.bottom}`);
    }""", [selector, frame])


@pytest.mark.parametrize("width,height", [(1280, 720), (1920, 1080)])
def test_beam_tree_opens_with_its_root_and_chosen_path_in_view(lab, width, height):
    page = open_lab(lab, width, height)
    page.click("#tab-beam")
    page.fill("#beam-form [name=num_beams]", "4")
    page.fill("#beam-form [name=max_new_tokens]", "12")  # the lab's longest: a tree wider than the page
    run_view(page, "#beam-run", "#beam-out svg.tree")
    root = page.locator("#beam-out g.node").filter(has_text="prompt")
    assert root.count() == 1 and "chosen" in root.get_attribute("class")
    chosen = page.locator("#beam-out g.node.chosen").count()
    assert chosen >= 5 and page.locator("#beam-out g.node").count() > 3 * chosen  # a tree, not a path
    assert in_view(page, "#beam-out g.node.chosen", "#beam-out .scroll") == []
    # the tree search's output, further down the page, is scrolled into view
    run_view(page, "#tree-run", "#tree-out svg.tree")
    assert in_view(page, "#tree-out g.node.chosen", "#tree-out .scroll") == []
    page.close()


# Pairwise overlaps of a view's fields, labels and controls (the header and tabs included), of
# its output's controls, and any of them outside the viewport horizontally; a tree node's
# text must stay inside its box. Nested elements (a label and its input) are not compared.
OVERLAPS = """() => {
  const view = "[role=tabpanel]:not([hidden])";
  const selector = ["header :is(label, input)", "[role=tab]",
    `${view} form :is(label, input, select, textarea, button, legend, .note, h2)`,
    `${view} .out :is(button, .chip, .legend li, .picks li, .budget, .answer)`].join(", ");
  const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") +
    (e.name ? `[name=${e.name}]` : "") +
    (e.dataset && e.dataset.field ? `[data-field=${e.dataset.field}]` : "") +
    ` "${(e.textContent || e.value || "").trim().slice(0, 24)}"`;
  const items = [...document.querySelectorAll(selector)].filter((e) => e.getClientRects().length)
    .map((e) => [e, e.getBoundingClientRect()]);
  const width = document.documentElement.clientWidth, problems = [];
  for (const [e, r] of items) {
    const where = `${r.left}..${r.right}`;
    if (r.left < 0 || r.right > width) problems.push(`${name(e)} is outside [0, ${width}]: ${where}`);
  }
  const overlap = (a, b) => [Math.min(a.right, b.right) - Math.max(a.left, b.left),
                             Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top)];
  for (let i = 0; i < items.length; i++) for (let j = i + 1; j < items.length; j++) {
    const [a, ra] = items[i], [b, rb] = items[j];
    if (a.contains(b) || b.contains(a)) continue;
    const [dx, dy] = overlap(ra, rb);
    const by = `${dx.toFixed(1)}x${dy.toFixed(1)} px`;
    if (dx > 0.5 && dy > 0.5) problems.push(`${name(a)} overlaps ${name(b)} by ${by}`);
  }
  for (const node of document.querySelectorAll(`${view} svg.tree g.node`)) {
    const box = node.querySelector("rect").getBoundingClientRect();
    for (const text of node.querySelectorAll("text")) {
      const r = text.getBoundingClientRect();
      const out = r.left < box.left || r.right > box.right + 0.5;
      if (out) problems.push(`tree text "${text.textContent}" leaves its box`);
    }
  }
  return problems;
}"""
RUNS = {  # each view's run buttons and what they draw
    "sampler": [("#sampler-run", "#sampler-tokens")],
    "beam": [("#beam-run", "#beam-out svg.tree"), ("#tree-run", "#tree-out svg.tree")],
    "speculative": [("#speculative-run", "#speculative-blocks")],
    "votes": [("#votes-run", "#votes-samples")],
}


def overlaps_in_every_view(page) -> dict[str, list[str]]:
    found = {}
    for view, runs in RUNS.items():
        page.click(f"#tab-{view}")
        for button, drawn in runs:
            run_view(page, button, drawn)
        found[view] = page.evaluate(OVERLAPS)
    return found


@pytest.mark.parametrize("width", [1280, 1366, 1600, 1920])
def test_no_fields_overlap_at_desktop_widths(lab, width):
    page = open_lab(lab, width)
    found = overlaps_in_every_view(page)
    page.close()
    assert found == {view: [] for view in RUNS}


def test_the_overlap_check_finds_a_broken_layout(lab):
    page = open_lab(lab, 1280)
    page.add_style_tag(content=".controls label { margin-right: -60px; } #chain input { width: 40em; }")
    found = overlaps_in_every_view(page)
    page.close()
    assert all(found.values()), found
    assert any("overlaps" in p for p in found["sampler"]) and any("outside" in p for p in found["sampler"])
