"""The lab page in a real browser: headless Chromium (Debian's `chromium`) driven by Playwright
loads /lab on the embedded models, runs each view and checks what it shows.

Skipped without playwright or a Chromium binary (scripts/setup.sh dev installs both when it
can). Screenshots go to a temporary directory, or to $DECODEKIT_LAB_SCREENSHOTS (the README's
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
def page(tmp_path_factory):
    import torch

    from decodekit.server.app import ServerThread, load_models
    from decodekit.server.backend import Backend, ServerConfig

    torch.set_num_threads(1)
    backend = Backend(load_models(["shakespeare"]), ServerConfig(kv_bytes=16 * 2**20))
    with ServerThread(backend) as server, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1366, "height": 860})
        page.set_default_timeout(60_000)
        page.goto(server.url + "/lab")
        page.wait_for_selector("body[data-ready=true]")
        yield page
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("DECODEKIT_LAB_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("lab-shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def kept(page, stage: str) -> int:
    return page.locator(f"#sampler-tokens td.kept[data-stage={stage}]").count()


def test_sampler_view_shows_what_top_k_removes(page, shots):
    page.fill("#chain li[data-adapter=top_k] input", "5")
    page.fill("#chain li[data-adapter=temperature] input", "0.8")
    page.click("#sampler-run")
    page.wait_for_selector("#sampler-tokens")
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
    page.click("#beam-run")
    page.wait_for_selector("#beam-out svg.tree")
    assert page.locator("#beam-out g.node.chosen").count() >= 5  # the prompt and 4 tokens
    assert page.locator("#beam-out g.node.pruned").count() > 0
    page.select_option("#tree-form [name=method]", "rebase")
    page.click("#tree-run")
    page.wait_for_selector("#tree-out svg.tree")
    assert page.locator("#tree-out g.node.chosen").count() >= 2
    assert "generator calls" in page.inner_text("#tree-out .budget")
    page.screenshot(path=shots / "lab-beam.png", full_page=True)


def test_speculative_view_accepts_draft_tokens_at_temperature_0(page, shots):
    page.click("#tab-speculative")
    page.fill("#speculative-form [name=temperature]", "0")
    page.click("#speculative-run")
    page.wait_for_selector("#speculative-blocks")
    assert page.locator("#speculative-blocks .chip.accepted").count() >= 1
    assert int(page.inner_text("td.accepted-total[data-rule=block]")) >= 1
    page.screenshot(path=shots / "lab-speculative.png", full_page=True)


def test_votes_view_shows_each_rule_pick(page, shots):
    page.click("#tab-votes")
    page.click("#votes-run")
    page.wait_for_selector("#votes-samples")
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
