"""The dashboard and playground at `/` in headless Chromium (Debian's chromium + chromium-driver,
driven by selenium) against a real `specdecode serve` on a tiny random Llama with the n-gram
drafter: greedy output of such a model repeats, so speculation is accepted deterministically."""
from __future__ import annotations

import shutil

import httpx
import pytest

from specdecode.bench.serve_server import LocalServer

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary (Debian: apt-get install chromium "
                                                          "chromium-driver; scripts/setup/setup.sh does it as root)")
PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox"
KINDS = ("accepted", "recovered", "bonus")


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    args = ["--model", str(tiny_models["llama"]), "--method", "ngram", "-k", "4", "--dtype", "fp32",
            "--threads", "1"]
    with LocalServer(args, tmp_path_factory.mktemp("dash") / "server.log", startup_timeout_s=120) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    driver_path = shutil.which("chromedriver")
    assert driver_path, "Chromium is installed but chromedriver is not: apt-get install chromium-driver"
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1400"):
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    driver.get(server.url + "/")
    yield driver
    driver.quit()


def wait(driver, condition, seconds: float = 20.0, message: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, seconds, poll_frequency=0.1).until(condition, message)


def by_id(driver, name: str):
    from selenium.webdriver.common.by import By
    return driver.find_element(By.ID, name)


def generate(driver, prompt: str, speculate: bool, max_tokens: int = 40, k: str = "4") -> list[tuple[str, str]]:
    """Fill the playground, click Generate, wait for the stream to end; (kind, text) per span."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    for name, value in (("pg-prompt", prompt), ("pg-max-tokens", str(max_tokens)), ("pg-temperature", "0")):
        field = by_id(driver, name)
        field.clear()
        field.send_keys(value)
    Select(by_id(driver, "pg-endpoint")).select_by_value("completions")
    if by_id(driver, "pg-speculate").is_selected() != speculate:
        by_id(driver, "pg-speculate").click()
    if speculate:
        by_id(driver, "pg-k").clear()
        by_id(driver, "pg-k").send_keys(k)
    by_id(driver, "pg-send").click()
    wait(driver, lambda d: by_id(d, "pg-status").get_attribute("data-state") in ("done", "error"),
         message="the playground's stream did not finish")
    status = by_id(driver, "pg-status")
    assert status.get_attribute("data-state") == "done", status.text
    spans = driver.find_elements(By.CSS_SELECTOR, "#pg-output span.tok")
    return [(s.get_attribute("data-kind"), s.get_attribute("textContent")) for s in spans]


def test_dashboard_renders_live_stats(browser, server):
    wait(browser, lambda d: by_id(d, "conn-status").get_attribute("data-state") == "live",
         message="the dashboard never fetched /api/stats")
    stats = httpx.get(server.url + "/api/stats", timeout=10).json()
    assert by_id(browser, "model-name").text == stats["model"]
    assert by_id(browser, "method-name").text == stats["method"]
    for name in ("stat-acceptance", "stat-mal", "stat-tokens-per-step", "stat-throughput", "stat-running",
                 "stat-waiting", "mem-weights-target", "mem-kv-target", "stat-prefix-hit-rate", "stat-prefix-cached"):
        assert by_id(browser, name).text not in ("", "–"), name
    # an idle server: the panel shows exactly what /api/stats says
    acceptance = float(by_id(browser, "stat-acceptance").get_attribute("data-value"))
    assert acceptance == pytest.approx(stats["speculation"]["acceptance_rate"])
    hit_rate = float(by_id(browser, "stat-prefix-hit-rate").get_attribute("data-value"))
    assert stats["prefix_cache"]["enabled"] and hit_rate == pytest.approx(stats["prefix_cache"]["hit_rate"])
    weights = float(by_id(browser, "mem-weights-target").get_attribute("data-value"))
    assert weights == stats["memory"]["weights_bytes"]["target"] > 0
    models = [o.get_attribute("value") for o in by_id(browser, "pg-model").find_elements("tag name", "option")]
    assert models and models[0] == httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    # the time-series charts draw once the server's history holds two points (one per second)
    wait(browser, lambda d: d.find_elements("css selector", "#chart-throughput path.line"),
         message="the throughput chart never drew a line")


def test_playground_colours_token_kinds_and_stats_follow(browser, server):
    kinds = generate(browser, PROMPT, speculate=True)
    assert kinds, "no token spans"
    assert {kind for kind, _ in kinds} <= set(KINDS), "a chunk came without token_kinds"
    counts = {kind: sum(k == kind for k, _ in kinds) for kind in KINDS}
    assert counts["accepted"] >= 1, counts
    for kind in KINDS:
        assert by_id(browser, f"pg-count-{kind}").text == str(counts[kind])
    assert by_id(browser, "pg-count-total").text == str(len(kinds)) and len(kinds) <= 40
    # every verify step ends with one recovered or bonus token: the spans must say so
    assert counts["recovered"] + counts["bonus"] >= 1
    # three kinds, three colours (the legend shows all three; a kind's spans share the legend's colour)
    legend = {kind: browser.find_element("css selector", f"#pg-legend .tok-{kind}") for kind in KINDS}
    colours = {kind: el.value_of_css_property("background-color") for kind, el in legend.items()}
    assert len(set(colours.values())) == 3, colours
    first_accepted = browser.find_element("css selector", "#pg-output span.tok-accepted")
    assert first_accepted.value_of_css_property("background-color") == colours["accepted"]
    # the stats panel shows the acceptance the request produced (the playground refreshes it when done)
    wait(browser, lambda d: float(by_id(d, "stat-acceptance").get_attribute("data-value")) > 0,
         message="the stats panel never showed non-zero acceptance")
    assert by_id(browser, "stat-acceptance").text.endswith("%")
    assert httpx.get(server.url + "/api/stats", timeout=10).json()["speculation"]["acceptance_rate"] > 0
    wait(browser, lambda d: int(float(by_id(d, "stat-finished").get_attribute("data-value"))) >= 1)
    wait(browser, lambda d: d.find_elements("css selector", "#chart-positions rect.bar"),
         message="no acceptance-per-position bars")
    # the last verified draft is drawn: one box per node plus the root, the accepted path highlighted
    tree = httpx.get(server.url + "/api/stats", timeout=10).json()["speculation"]["last_tree"]
    wait(browser, lambda d: int(by_id(d, "pg-tree").get_attribute("data-nodes") or 0) > 0,
         message="the draft tree was never drawn")
    svg = by_id(browser, "pg-tree")
    boxes = svg.find_elements("css selector", "g.tree-node")
    assert len(svg.find_elements("css selector", "g.tree-node.root")) == 1
    drawn_nodes = int(svg.get_attribute("data-nodes"))
    assert len(boxes) in (drawn_nodes + 1, drawn_nodes + 2)           # root, nodes, maybe the extra token
    assert int(svg.get_attribute("data-accepted")) == len(svg.find_elements("css selector", "g.tree-node.accepted"))
    assert tree is not None and by_id(browser, "stat-tree-nodes").text != "–"


def test_playground_speculation_off_gives_only_target_tokens(browser):
    kinds = generate(browser, PROMPT, speculate=False, max_tokens=12)
    assert kinds and all(kind == "bonus" for kind, _ in kinds), kinds
    assert by_id(browser, "pg-count-accepted").text == "0"


def test_playground_shows_server_errors(browser):
    by_id(browser, "pg-max-tokens").clear()
    by_id(browser, "pg-max-tokens").send_keys("100000")       # prompt + max_tokens over the 256-token context
    by_id(browser, "pg-send").click()
    wait(browser, lambda d: by_id(d, "pg-status").get_attribute("data-state") in ("done", "error"))
    status = by_id(browser, "pg-status")
    assert status.get_attribute("data-state") == "error" and "HTTP 400" in status.text, status.text
    assert "max_tokens" in status.text or "100000" in status.text, status.text
    assert not browser.find_elements("css selector", "#pg-output span.tok")


def test_no_script_errors(browser):
    errors = [e for e in browser.get_log("browser")   # the deliberate 400 above is logged by the browser
              if e["level"] == "SEVERE" and "status of 400" not in e["message"]]
    assert not errors, errors
