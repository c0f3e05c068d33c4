"""The built site in a real browser: headless Chromium (OS package) driven by Playwright over loopback HTTP."""
import functools
import http.server
import os
import threading
import time
from pathlib import Path

import pytest


pytestmark = [pytest.mark.browser, pytest.mark.content]  # drives the site built from docs/ and baselines/
CHROMIUM = Path("/usr/bin/chromium")
# without the networking flags Chromium keeps trying to reach the outside
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]

from playwright import sync_api  # noqa: E402 - playwright is in the test extra: a missing one is a failure

if not CHROMIUM.exists():
    if os.environ.get("CI"):  # .ci/run installs it; a CI without it would skip these tests silently
        raise RuntimeError("CI needs Chromium from the OS packages (apt-get install chromium)")
    pytest.skip("needs Chromium from the OS packages (apt-get install chromium)", allow_module_level=True)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def base_url(built):
    out = built[0]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def page(base_url, tmp_path_factory):
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")),
                                                       executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        pg = context.new_page()
        pg.set_default_timeout(20_000)
        pg.errors = []  # console errors and uncaught exceptions (a broken search index shows only here)
        pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)
        pg.on("pageerror", lambda e: pg.errors.append(str(e)))
        yield pg
        context.close()


def test_navigation(page, base_url):
    page.goto(base_url)
    assert "The project" in page.title()
    for label, path, heading in [("Findings", "findings/", "Findings"), ("Decisions", "decisions/", "Decision"),
                                 ("Runbook guide", "runbooks/", "Runbook guide")]:
        page.locator("nav.md-nav--primary").get_by_role("link", name=label, exact=True).first.click()
        page.wait_for_url(base_url + path)
        assert heading in page.locator("h1").first.inner_text()


def test_search_finds_the_findings_page(page, base_url):
    page.goto(base_url)
    page.locator("label.md-search__icon, .md-search__input").first.click()
    box, results = page.locator("input.md-search__input"), page.locator(".md-search-result__list a")
    # the index loads in a web worker; a query typed before it is ready finds nothing, so type again until it is
    deadline = time.monotonic() + 60
    while results.count() == 0 and time.monotonic() < deadline:
        box.fill("")
        box.type("CUDA graph")
        page.wait_for_timeout(1000)
    hrefs = [results.nth(i).get_attribute("href") for i in range(results.count())]
    assert any("findings/" in h for h in hrefs), (hrefs, page.errors)
    assert page.errors == []


def test_dashboard_numbers_equal_the_records(page, base_url, built):
    page.goto(base_url + "dashboard/")
    cells = page.locator("td.value[data-record]")
    shown = {cells.nth(i).get_attribute("data-record"): cells.nth(i).inner_text() for i in range(cells.count())}
    expected = built[1]
    assert expected and set(shown) == set(expected)
    for key, value in expected.items():
        assert float(shown[key]) == pytest.approx(value, rel=1e-5), key
    badge = page.locator('td.value[data-record="baseline-k25-sglang/8x-rtx-pro-6000/baseline_tok_s"] ~ td .verdict')
    assert badge.inner_text() == "reported"
