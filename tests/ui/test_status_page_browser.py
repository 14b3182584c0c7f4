"""The status page in a real browser: Debian's headless Chromium (``/usr/bin/chromium``) driven
through ``/usr/bin/chromedriver`` by Selenium (nothing downloads a browser or a driver) opens
``/ui`` of a running ``wowd run`` with demo data, finds the overview's numbers equal to ``wowd
status --json``, goes to a failed timer, retries it with the token and sees it delivered (its
command in the outbox). A screenshot of each page is saved (``make screenshots``: to ``docs/img/``,
which docs/operations.md shows).

Without the browser the test is skipped, and fails instead with ``WOWD_TEST_REQUIRE_BROWSER=1``
(``.ci/run`` sets it where it installed ``chromium`` and ``chromium-driver``)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.factories import CONTEXT, PARTITIONS, commit, now_ms, ref, timer
from tests.processes import Replica, base_env, run_wowd
from wowd.model import (
    AggregateType,
    Command,
    TimerChange,
    commit_to_doc,
    partition,
)
from wowd.stores.base import Backend

pytestmark = [pytest.mark.anyio, pytest.mark.process, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REQUIRE = os.environ.get("WOWD_TEST_REQUIRE_BROWSER") == "1"
SHOTS = Path(os.environ.get("WOWD_TEST_SCREENSHOTS") or tempfile.mkdtemp(prefix="wowd-ui-shots-"))
"""Where the screenshots go: ``make screenshots`` points it at docs/img (used by docs/operations.md);
a plain test run writes them to a temporary directory (the tree is left as it was)."""
TOKEN = "ui-browser-token-3317"
WAIT_S = 20


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Future[Any]]:
    """A headless Chromium session (a laptop's window, 1366x860), starting in a thread while the
    test starts its replica: the future's result."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        why = f"no browser: {', '.join(missing)} missing (apt-get install chromium chromium-driver)"
        if REQUIRE:
            pytest.fail(f"{why} (WOWD_TEST_REQUIRE_BROWSER=1)")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager never fetches a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1366,860"):
        options.add_argument(arg)
    with ThreadPoolExecutor(max_workers=1) as pool:
        driver = pool.submit(webdriver.Chrome, options=options, service=Service(executable_path=str(CHROMEDRIVER)))
        try:
            yield driver
        finally:
            driver.result().quit()


async def _seed(stores: Backend) -> None:
    """The order o-7's timer ``expire``, FAILED (the target refused it), and a quarantined commit;
    the order's tenant and id are as long as real ones are (the tables fit a laptop's width)."""
    owner = ref("o-7-checkout-2026-12-06-europe-west-1", tenant="acme-europe-west")
    expire = Command(name="expire-order", body={"order": "o-7"})
    t = timer(owner=owner, due_at=now_ms() - 60_000, key="expire", partitions=PARTITIONS, command=expire)
    await stores.timers.prepare()
    assert await stores.timers.put(t)
    loaded = await stores.timer_queries.find(owner, "expire")
    assert loaded is not None
    reason = "http 422 from the target: order o-7 is closed"
    assert await stores.firing.settle([TimerChange.fail(loaded, fence=1, reason=reason)])
    raw = commit_to_doc(commit("o-8", 3), PARTITIONS)
    order = AggregateType(context=CONTEXT, aggregate="order")
    reason = "sink refused it: InvalidInput: events: mapper_parsing_exception"
    await stores.quarantine.put("wowd", partition("o-8", PARTITIONS), order, raw, reason)


def _browse(driver: Any, base: str, status: Callable[[], dict[str, Any]]) -> None:
    """The operator's path: overview, failed timers, the timer, retry, the outbox."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import presence_of_element_located, staleness_of
    from selenium.webdriver.support.ui import Select, WebDriverWait

    SHOTS.mkdir(parents=True, exist_ok=True)

    def text(css: str) -> str:
        found = WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(
            presence_of_element_located((By.CSS_SELECTOR, css)), css
        )
        return str(found.text).strip()

    def gone(element: Any) -> Callable[[Any], bool]:
        """``staleness_of``, with Chromium's other answer for an element the navigation removed
        from its document ("Node with given id does not belong to the document") taken as stale."""
        stale = staleness_of(element)

        def check(d: Any) -> bool:
            try:
                return bool(stale(d))
            except WebDriverException as exc:
                if "does not belong to the document" in str(exc.msg):
                    return True
                raise

        return check

    def loaded(d: Any) -> bool:
        return bool(d.execute_script("return document.readyState") == "complete")

    def follow(element: Any) -> None:
        """Clicks a link or a form's button and waits for the page it loads: the one before gone,
        the new one parsed and loaded."""
        page = driver.find_element(By.TAG_NAME, "html")
        element.click()
        WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(gone(page), "the next page")
        WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(loaded, "the next page loaded")

    def fits(page: str) -> None:
        """The page and each of its tables fit a 1280-pixel window: no table is wider than its
        box (long ids and texts wrap)."""
        width = driver.execute_script("return document.documentElement.scrollWidth")
        inner = driver.execute_script("return document.documentElement.clientWidth")
        assert width <= inner, f"{page}: {width} px wide in a window of {inner} px"
        wide = driver.execute_script(
            "return [...document.querySelectorAll('.scroll')].filter(b => b.scrollWidth > b.clientWidth)"
            ".map(b => (b.querySelector('table') || b).id + ': ' + b.scrollWidth + ' > ' + b.clientWidth)"
        )
        assert wide == [], f"{page}: tables wider than their box: {wide}"

    driver.set_window_size(1280, 860)
    driver.get(f"{base}/ui")
    fits("overview")
    shown = {
        "holding": int(text("#replicas-holding")),
        "standby": int(text("#replicas-standby")),
        "quarantined": int(text("#quarantined")),
        "outbox": int(text("#outbox-depth")),
        "due": int(text("#due-backlog")),
        "slots": [
            (int(row.get_attribute("data-slot")), row.find_elements(By.TAG_NAME, "td")[2].text)
            for row in driver.find_elements(By.CSS_SELECTOR, "#slots tbody tr")
        ],
        "holders": [
            row.find_elements(By.TAG_NAME, "td")[1].text
            for row in driver.find_elements(By.CSS_SELECTOR, "#slots tbody tr")
        ],
    }
    doc = status()
    assert shown == {
        "holding": sum(1 for r in doc["replicas"] if r["state"] == "holding"),
        "standby": len(doc["standbys"]),
        "quarantined": doc["quarantined"],
        "outbox": doc["outbox"]["depth"],
        "due": sum(r["due_backlog"] for r in doc["slots"]),
        "slots": [(r["slot"], str(r["fence"])) for r in doc["slots"]],
        "holders": [r["holder"] for r in doc["slots"]],
    }
    assert shown["quarantined"] == 1 and shown["holding"] == 1
    driver.save_screenshot(str(SHOTS / "ui-overview.png"))

    follow(driver.find_element(By.LINK_TEXT, "Timers"))
    Select(driver.find_element(By.NAME, "status")).select_by_value("FAILED")
    follow(driver.find_element(By.CSS_SELECTOR, "form.search button"))
    rows = driver.find_elements(By.CSS_SELECTOR, "#timers tbody tr")
    assert len(rows) == 1 and "order o-7 is closed" in rows[0].text
    fits("timers")
    driver.save_screenshot(str(SHOTS / "ui-timers.png"))

    follow(rows[0].find_element(By.LINK_TEXT, "expire"))
    assert text("#timer-status") == "FAILED"
    assert "http 422 from the target: order o-7 is closed" in text("#timer-last-error")
    timer_id = driver.find_element(By.CSS_SELECTOR, "#timer dd:last-of-type code").text
    fits("timer")
    driver.save_screenshot(str(SHOTS / "ui-timer.png"))

    driver.find_element(By.NAME, "token").send_keys(TOKEN)
    follow(driver.find_element(By.CSS_SELECTOR, "form.action button"))
    assert "retried: back to PENDING, due now" in text("#done")

    def delivered(d: Any) -> bool:
        d.get(f"{base}/ui/outbox")
        return bool(d.find_elements(By.CSS_SELECTOR, f'#outbox tr[data-timer-id="{timer_id}"]'))

    WebDriverWait(driver, WAIT_S, poll_frequency=0.2).until(delivered, "the retried timer's command in the outbox")
    fits("outbox")
    driver.save_screenshot(str(SHOTS / "ui-outbox.png"))
    row = driver.find_element(By.CSS_SELECTOR, f'#outbox tr[data-timer-id="{timer_id}"]')
    request_id = row.find_element(By.CSS_SELECTOR, 'a[href^="/ui/outbox/entry"]').text.strip()

    driver.get(f"{base}/ui/timers?status=FAILED")
    assert "no live timer matches" in text("#timers")

    # gone from the view, the timer is found by the request id of its outbox entry: its history
    driver.get(f"{base}/ui/timers")
    driver.find_element(By.NAME, "request_id").send_keys(request_id)
    follow(driver.find_element(By.CSS_SELECTOR, "form.search button"))
    follow(driver.find_element(By.CSS_SELECTOR, "#timers tbody a"))
    assert text("#timer-status") == "DONE"
    attempts = driver.find_elements(By.CSS_SELECTOR, '#history tr[data-kind="attempt"]')
    assert attempts and "delivered" in attempts[-1].text and request_id in attempts[-1].text
    fits("history")
    driver.save_screenshot(str(SHOTS / "ui-timer-history.png"))

    driver.get(f"{base}/ui/quarantine")
    fits("quarantine")
    driver.save_screenshot(str(SHOTS / "ui-quarantine.png"))
    follow(driver.find_element(By.CSS_SELECTOR, "#quarantine tbody a"))
    assert "mapper_parsing_exception" in text("#reason")
    driver.save_screenshot(str(SHOTS / "ui-quarantine-item.png"))

    # a commit that will never apply, dismissed with the reason: out of the listing, kept for audit
    item_id = driver.current_url.rstrip("/").rpartition("/")[2]
    dismiss = driver.find_element(By.CSS_SELECTOR, 'form.action[action$="/dismiss"]')
    dismiss.find_element(By.NAME, "reason").send_keys("a test commit of the load test")
    dismiss.find_element(By.NAME, "token").send_keys(TOKEN)
    follow(dismiss.find_element(By.CSS_SELECTOR, "button"))
    assert f"{item_id} dismissed: a test commit of the load test" in text("#done")
    text("#quarantine")

    def listed() -> list[str]:
        return [a.text.strip() for a in driver.find_elements(By.CSS_SELECTOR, "#quarantine tbody a")]

    assert item_id not in listed()
    follow(driver.find_element(By.ID, "dismissed"))
    assert item_id in listed() and "a test commit of the load test" in text("#quarantine")


async def test_an_operator_finds_and_retries_a_failed_timer_in_a_browser(
    browser: Future[Any], spawn: Callable[..., Replica], db: Path, tmp_path: Path, stores: Backend
) -> None:
    env = base_env(db, WOWD_LEASE__LIMIT="1", WOWD_UI__TOKEN=TOKEN)
    rc, out, err = await run_wowd(
        "demo",
        "--commits",
        "40",
        "--timers",
        "40",
        "--due-in-ms",
        "600000",
        "--aggregates",
        "10",
        env=env,
        cwd=tmp_path,
    )
    assert rc == 0, err
    await _seed(stores)
    replica = spawn("a", env)
    await replica.wait_ready()

    async def status_now() -> dict[str, Any]:
        code, out, err = await run_wowd("status", "--json", env=env, cwd=tmp_path)
        assert code == 0, err
        return json.loads(out)  # type: ignore[no-any-return]

    driver = await anyio.to_thread.run_sync(browser.result)
    # the browser runs in a worker thread; wowd status --json runs in this loop, through the portal
    async with anyio.from_thread.BlockingPortal() as portal:
        await anyio.to_thread.run_sync(
            _browse, driver, f"http://127.0.0.1:{replica.port}", lambda: portal.call(status_now)
        )
