"""The web UI in a real browser: Debian's headless Chromium driven by Selenium through
chromedriver, against a real ``kestrel-runtime serve``, real workers and PostgreSQL.

An operator logs in with a token, finds a waiting incident, approves it and sees it
complete; the same flow without a session, or with a read-only token, is refused and
changes nothing. Every page a test visits must render without an error page and without a
SEVERE browser console entry (a failed resource, a CSP violation, a script error).

``KESTREL_UPDATE_SCREENSHOTS=1`` (``python tools/screenshots.py``) writes the screenshots of
the main pages into docs/screenshots/ for the README; otherwise they go to a temporary
directory, and are still checked to be PNG images.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from kestrel.client import SyncClient
from tests.helpers import ROOT, q, q1, wait_until
from tests.ui_helpers import UiServer, ui_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SHOTS = ROOT / "docs" / "screenshots"

# .ci/run installs the browser and sets KESTREL_REQUIRE_BROWSER=1: there these tests never
# skip. Elsewhere, a machine without Debian's chromium skips them with the reason.
if (not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists())
        and os.environ.get("KESTREL_REQUIRE_BROWSER") != "1"):
    pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def server(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    with ui_server(pg_dsn, tmp_path_factory.mktemp("browser")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: UiServer) -> Iterator[SyncClient]:
    c = SyncClient(server.dsn, schema=server.schema, pool_size=1)
    yield c
    c.close()


@pytest.fixture
def driver() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--force-device-scale-factor=1",
                "--disable-extensions", "--no-first-run", "--lang=en-US"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    browser = webdriver.Chrome(options=options, service=service)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()


def follow(browser: Any, element: Any, *, submit: bool = False) -> None:
    """Click *element* (or submit its form) and wait for the page it leads to: a new
    document (the old one's marker gone), fully loaded."""
    browser.execute_script("window.__kestrelOldPage = true")
    (element.submit if submit else element.click)()
    # Mid-navigation chromedriver may answer with a transient error: look again.
    WebDriverWait(browser, 30, ignored_exceptions=[WebDriverException]).until(
        lambda b: b.execute_script("return window.__kestrelOldPage === undefined "
                                   "&& document.readyState === 'complete'"))


def severe_console_entries(browser: Any) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def assert_page_ok(browser: Any) -> None:
    """The page is not an error page, and the console has logged no error since the last
    check (get_log drains it)."""
    errors = browser.find_elements(By.CSS_SELECTOR, "section.error")
    assert errors == [], f"{browser.current_url}: {errors[0].text}"
    assert severe_console_entries(browser) == [], browser.current_url


def refusal(browser: Any) -> str:
    """The one-line reason of the error page now shown. The console must have logged the
    4xx (which shows that :func:`assert_page_ok` would see an error page's load)."""
    reason = browser.find_element(By.ID, "reason").text
    assert any("status of 40" in e for e in severe_console_entries(browser))
    return str(reason)


def log_in(browser: Any, server: UiServer, token: str, path: str = "/ui/") -> None:
    browser.get(server.base + path)
    assert "/ui/login" in browser.current_url
    assert_page_ok(browser)
    browser.find_element(By.ID, "token").send_keys(token)
    follow(browser, browser.find_element(By.ID, "login"))
    assert "/ui/login" not in browser.current_url


def shot(browser: Any, name: str, tmp: Path) -> None:
    """Save a screenshot (to docs/screenshots with KESTREL_UPDATE_SCREENSHOTS=1)."""
    folder = SHOTS if os.environ.get("KESTREL_UPDATE_SCREENSHOTS") == "1" else tmp
    folder.mkdir(parents=True, exist_ok=True)
    png = browser.get_screenshot_as_png()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    (folder / f"{name}.png").write_bytes(png)


def before(browser: Any, first: str, then: str) -> bool:
    """Whether the element *first* comes before *then* in the page (CSS selectors)."""
    return bool(browser.execute_script(
        "const a = document.querySelector(arguments[0]), b = document.querySelector(arguments[1]);"
        "return a !== null && b !== null && "
        "(a.compareDocumentPosition(b) & Node.DOCUMENT_POSITION_FOLLOWING) !== 0;",
        first, then))


def on_first_screen(browser: Any, selector: str) -> bool:
    """Whether *selector* is seen without scrolling (above the fold) at the window's size."""
    browser.execute_script("window.scrollTo(0, 0)")
    return bool(browser.execute_script(
        "const r = document.querySelector(arguments[0]).getBoundingClientRect();"
        "return r.height > 0 && r.top >= 0 && r.bottom <= window.innerHeight;", selector))


def shows(browser: Any, selector: str) -> bool:
    """Whether the page now shows *selector* (a page reloading may answer nothing yet)."""
    try:
        return bool(browser.find_elements(By.CSS_SELECTOR, selector))
    except WebDriverException:
        return False


def hold(server: UiServer, eid: str, queue: str) -> None:
    """Move a waiting execution to *queue*: one no worker serves holds it (a signal then
    waits unconsumed), "default" releases it."""
    q(server.dsn, server.schema,
      "UPDATE {s}.workflow_executions SET queue = %s WHERE id = %s", [queue, eid])


ALERT = {"alert": "KubePodCrashLooping", "namespace": "prod"}


def incident(client: SyncClient, workload: str) -> str:
    eid = str(client.submit("incident_response", {**ALERT, "workload": workload}).id)
    wait_until(lambda: client.get(eid).status.value == "waiting", timeout=60,
               what=f"{workload} waiting for approval")
    return eid


def signals(server: UiServer, eid: str) -> int:
    return int(q1(server.dsn, server.schema,
                  "SELECT count(*) FROM (SELECT execution_id FROM {s}.signals UNION ALL "
                  "SELECT execution_id FROM {s}.signal_history) AS s WHERE execution_id = %s",
                  [eid]))  # sent, whether the execution is live or finished


def test_an_operator_logs_in_finds_the_waiting_incident_and_approves_it(
        server: UiServer, client: SyncClient, driver: Any, tmp_path: Path) -> None:
    # Some history first, so the pages look like an ordinary day.
    for n, approved in ((1, True), (2, False)):
        done = incident(client, f"checkout-{n}")
        client.signal(done, "approval", {"approved": approved, "by": "bob"})
        client.result(done, timeout=60)
    failed = str(client.submit("http.fails").id)
    client.submit("http.steps", 4).result(timeout=60)
    wait_until(lambda: client.get(failed).status.value == "failed", timeout=60, what="failed")
    eid = incident(client, "payments-api")

    log_in(driver, server, server.tokens["operator"])
    assert driver.current_url == server.base + "/ui/"
    assert_page_ok(driver)
    shot(driver, "executions", tmp_path)
    # The live counts follow the database without a reload (the page's one script).
    counter = driver.find_element(By.CSS_SELECTOR, "[data-count='live.waiting']")
    assert counter.text == "1"
    extra = incident(client, "cart-api")
    wait_until(lambda: counter.text == "2", timeout=30, interval=0.5, what="count refreshed")
    client.cancel(extra)
    wait_until(lambda: counter.text == "1", timeout=30, interval=0.5, what="count refreshed")
    assert_page_ok(driver)

    follow(driver, driver.find_element(By.CSS_SELECTOR, "a.count.st-waiting"))
    assert driver.current_url.endswith("/ui/?status=waiting")
    assert_page_ok(driver)
    # Each waiting row says what it waits for and since when (relative and absolute).
    link = driver.find_element(By.CSS_SELECTOR, f"a[href='/ui/executions/{eid}']")
    row = link.find_element(By.XPATH, "./ancestor::tr")
    assert re.fullmatch(r"waiting for signal approval · since \d+ s "
                        r"\(\d{4}-\d\d-\d\d \d\d:\d\d UTC\)",
                        row.find_element(By.CSS_SELECTOR, ".wait").text)
    follow(driver, link)
    assert_page_ok(driver)
    waiting = driver.find_element(By.ID, "waiting").text
    assert "Waiting for signal approval" in waiting and "Since " in waiting
    steps = driver.find_elements(By.CSS_SELECTOR, "ol.timeline > li")
    assert len(steps) >= 2 and "analyze_root_cause" in steps[0].text
    # The alert comes first: before the timeline, its Approve on the first screen.
    assert before(driver, "#waiting", "ol.timeline") and before(driver, "#waiting", "dl.facts")
    assert on_first_screen(driver, "#approve")
    shot(driver, "execution-waiting", tmp_path)
    driver.set_window_size(390, 844)
    shot(driver, "execution-phone", tmp_path)
    assert on_first_screen(driver, "#approve")
    for path in ("/ui/executions/" + eid, "/ui/", "/ui/queues", "/ui/search",
                 "/ui/bulk/cancel?status=waiting"):
        driver.get(server.base + path)  # readable on a phone: nothing wider than the screen
        assert driver.execute_script(
            "return document.documentElement.scrollWidth <= window.innerWidth"), path
    driver.set_window_size(1280, 900)
    driver.get(f"{server.base}/ui/executions/{eid}")

    # Approve: POST, then redirect back to the page read again, which says what was sent and
    # shows the new state. The execution is held on a queue no worker serves meanwhile, so
    # the page is seen between the approval and the resume, whatever the workers' speed.
    hold(server, eid, "ui-held")
    follow(driver, driver.find_element(By.ID, "approve"))
    assert_page_ok(driver)
    assert driver.current_url.startswith(
        f"{server.base}/ui/executions/{eid}?done=approve&sent=approve%3A")
    notice = driver.find_element(By.ID, "notice").text
    assert notice.startswith("Approval sent. Signal approval, sent ")
    assert '"approved": true' in notice and '"by": "ana"' in notice
    assert driver.find_elements(By.ID, "approve") == []
    assert "Signal approval received" in driver.find_element(By.ID, "arrived").text
    # Released, it resumes and completes; the page reloads itself (no refresh here).
    hold(server, eid, "default")
    wait_until(lambda: shows(driver, "h1 .st-completed"), timeout=60, interval=0.5,
               what="the page reloading to the completed incident")
    assert_page_ok(driver)
    assert driver.find_element(By.ID, "notice").text.startswith("Approval sent. Signal approval")
    result = driver.find_element(By.ID, "result").text
    assert '"outcome": "pr_opened"' in result and '"by": "ana"' in result
    assert driver.find_elements(By.ID, "approve") == []
    assert signals(server, eid) == 1

    # Live work for the queues page: a limited queue no worker here serves, and a wait.
    q(server.dsn, server.schema, "INSERT INTO {s}.queue_limits (queue, concurrency, rate, "
      "period) VALUES ('ai-model', 5, 60, interval '60 seconds')")
    for n in range(3):
        client.submit("http.echo", n, queue="ai-model")
    incident(client, "inventory-api")
    follow(driver, driver.find_element(By.LINK_TEXT, "Queues"))
    assert_page_ok(driver)
    rows = {r.find_element(By.CSS_SELECTOR, "td").text: r.text
            for r in driver.find_elements(By.CSS_SELECTOR, "table.list tbody tr")}
    assert rows["ai-model"].split()[1:4] == ["3", "0", "0"] and "60 per 60 s" in rows["ai-model"]
    assert rows["default"].split()[3] == "1"  # inventory-api waits
    shot(driver, "queues", tmp_path)
    follow(driver, driver.find_element(By.LINK_TEXT, "Schedules"))
    assert_page_ok(driver)
    follow(driver, driver.find_element(By.LINK_TEXT, "Search"))
    box = driver.find_element(By.NAME, "q")
    box.send_keys("payments-api")
    follow(driver, box, submit=True)
    assert_page_ok(driver)
    assert driver.find_elements(By.CSS_SELECTOR, f"a[href='/ui/executions/{eid}']")
    driver.get(f"{server.base}/ui/executions/{failed}")
    assert_page_ok(driver)
    assert "exploded on purpose" in driver.find_element(By.CSS_SELECTOR, "pre.err").text
    # The failure is the alert: first, its message and the failed step's traceback as text
    # with real line breaks (the workflow's traceback and the raw JSON folded below).
    assert before(driver, "#failure", "ol.timeline") and before(driver, "#failure", "dl.facts")
    assert "exploded on purpose" in driver.find_element(By.ID, "failure-message").text
    for ident in ("step-traceback", "traceback"):  # the workflow's folded, as the JSON
        lines = driver.find_element(By.ID, ident).get_attribute("textContent").splitlines()
        assert lines[0] == "Traceback (most recent call last):", ident
        assert any(line.startswith('  File "') for line in lines), ident
        assert "exploded on purpose" in lines[-1], ident
    assert driver.find_element(By.ID, "step-traceback").is_displayed()
    assert not driver.find_element(By.ID, "traceback").is_displayed()
    raw = driver.find_element(By.ID, "raw-error")
    assert not raw.is_displayed()  # folded in its <details>
    assert "Traceback (most recent call last):\\n" in raw.get_attribute("textContent")
    shot(driver, "execution-failed", tmp_path)
    follow(driver, driver.find_element(By.CSS_SELECTOR, "button.link"))  # log out
    assert "/ui/login" in driver.current_url
    driver.get(server.base + "/ui/queues")
    assert "/ui/login" in driver.current_url


def test_the_same_flow_without_a_session_or_with_a_read_only_token_is_refused(
        server: UiServer, client: SyncClient, driver: Any) -> None:
    eid = incident(client, "billing-worker")
    page = f"{server.base}/ui/executions/{eid}"

    driver.get(page)  # no session: the login page, then back here
    assert "/ui/login?next=%2Fui%2Fexecutions%2F" in driver.current_url
    driver.find_element(By.ID, "token").send_keys("kst_not_a_token")
    follow(driver, driver.find_element(By.ID, "login"))
    assert refusal(driver) == "malformed token (kst_…)"

    log_in(driver, server, server.tokens["operator"], f"/ui/executions/{eid}")
    assert driver.current_url == page
    assert_page_ok(driver)
    driver.delete_all_cookies()  # the session ends while the form is on screen
    follow(driver, driver.find_element(By.ID, "approve"))
    assert "not logged in" in refusal(driver)

    driver.get(server.base + "/ui/")
    log_in(driver, server, server.tokens["reader"], f"/ui/executions/{eid}")
    assert_page_ok(driver)
    assert driver.find_elements(By.ID, "approve") == []
    assert driver.find_elements(By.ID, "cancel") == []
    # A hand-made form with this session's own CSRF token: the scope still refuses it.
    driver.execute_script("""
        const f = document.createElement('form');
        f.method = 'post'; f.action = arguments[0];
        for (const [k, v] of [['csrf', arguments[1]], ['name', 'approval']]) {
            const i = document.createElement('input');
            i.type = 'hidden'; i.name = k; i.value = v; f.appendChild(i);
        }
        document.body.appendChild(f); f.submit();
    """, f"/ui/executions/{eid}/approve",
        driver.find_element(By.CSS_SELECTOR, "input[name=csrf]").get_attribute("value"))
    wait_until(lambda: driver.find_elements(By.ID, "reason"), timeout=30, what="a refusal")
    assert refusal(driver) == "this token lacks the 'operate' scope"

    assert client.get(eid).status.value == "waiting" and signals(server, eid) == 0
    client.cancel(eid)
