"""cube-transfer's status page in a real headless browser (Debian's chromium through
selenium) against a live local cluster: the token prompt, a rollout shown in progress and then
the new version, the rollback button (and, after it, the roll-forward one), the history in time
order with how long each version took, a screenshot written by the test, and the Retry button
of a version abandoned after its every attempt failed (once its input is fixed). The page's pure
helpers (the took column's format) also run under node."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from cube.donefile import append_line, format_line
from cube.processes import poll_until
from cube.seqfile import SequenceFileWriter
from cube.transfer.local import ClusterSpec, up
from cube.values import ValueColumn

if TYPE_CHECKING:
    from selenium.webdriver import Chrome

pytestmark = pytest.mark.slow  # a browser, node, a live cluster
needs_chromium = pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs Debian's chromium and chromium-driver (make debs)",
)
STATUS_JS = Path(__file__).resolve().parent.parent / "transfer" / "page" / "status.js"

TOKEN = "page-t0ken"
WAIT = 90.0
B1, B2 = "1700000000", "1700001000"


def took_shown(took: float | None, cell: str) -> bool:
    """Whether the took column's `cell` shows the API's `took` (seconds; None in progress):
    milliseconds under a second, seconds to a tenth from one on."""
    if took is None:
        return cell == ""
    number, _, unit = cell.partition(" ")
    if unit == "ms":
        return took < 0.9995 and abs(int(number) / 1000 - took) <= 0.0005 + 1e-9
    return unit == "s" and took >= 0.9995 and abs(float(number) - took) <= 0.05 + 1e-9


def write_input(root: Path, version: str, n: int) -> Path:
    """A base's input folder, root/input/<version>: one SequenceFile of `n` records."""
    keys = np.arange(1, n + 1, dtype=np.uint64)
    values = np.random.default_rng(int(version) % 97).standard_normal((n, 16)).astype(np.float32)
    source = root / "input" / version
    source.mkdir(parents=True)
    with SequenceFileWriter(source / "part-00000") as writer:
        writer.write_batch(keys, ValueColumn.fixed(values.view(np.uint8).reshape(-1), 64))
    return source


def publish(donefile: Path, root: Path, version: str, n: int) -> None:
    source = write_input(root, version, n)
    append_line(donefile / "base.txt", format_line(version, version, str(source)))


def log_in(browser: Chrome) -> None:
    """Answer the page's token prompt (the API needs TOKEN)."""
    from selenium.webdriver.common.by import By

    assert poll_until(lambda: browser.find_element(By.ID, "login").is_displayed(), 20, 0.1)
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()


@pytest.fixture
def browser() -> Iterator[Chrome]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium") or ""
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.mark.skipif(not shutil.which("node"), reason="needs node")
def test_the_took_column_shows_sub_second_durations() -> None:
    """create_time and finish_time are whole seconds (the original's ints): the column reads
    the API's float `took`, in milliseconds under a second."""
    records: list[dict[str, float | None]] = [
        {"took": t} for t in (0.42, 0.0004, 0.0, 0.9994, 0.9996, 1.0, 83.21, 4000.04)
    ]
    records += [{"took": None}, {"create_time": 100, "finish_time": 101}]
    script = "const { took } = require(process.argv[1]);"
    script += " console.log(JSON.stringify(JSON.parse(process.argv[2]).map(took)));"
    node = shutil.which("node") or "node"
    done = subprocess.run(
        [node, "-e", script, str(STATUS_JS), json.dumps(records)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert json.loads(done.stdout) == [
        "420 ms", "0 ms", "0 ms", "999 ms", "1.0 s", "1.0 s", "83.2 s", "4000.0 s", "", "",
    ]  # fmt: skip


@needs_chromium
def test_status_page_follows_a_rollout_and_rolls_back(tmp_path: Path, browser: Chrome) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    donefile = tmp_path / "donefile"
    donefile.mkdir()
    spec = ClusterSpec(
        dir=tmp_path / "cluster", shards=1, replicas=2, donefile=donefile, poll_interval=0.2,
        transfer_overrides={"api_token": TOKEN},
    )  # fmt: skip
    cluster = up(spec)
    try:
        publish(donefile, tmp_path, B1, 2000)
        cluster.wait_version(B1, WAIT)
        browser.get(f"{cluster.transfer_url}/?poll_ms=200")

        def text(element_id: str) -> str:
            return browser.find_element(By.ID, element_id).text

        # the API needs its token: the page asks for it once
        assert poll_until(lambda: browser.find_element(By.ID, "login").is_displayed(), 20, 0.1)
        assert "token" in text("problem")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        assert poll_until(lambda: text("live") == B1, 20, 0.1), text("problem")
        # the page re-renders its tables as it polls: read them in one script call
        rows = browser.execute_script(
            "return [...document.querySelectorAll('#replicas tbody tr')].map(r => r.textContent)"
        )
        assert len(rows) == 2 and all(B1 in row for row in rows), rows

        # a bigger base: the page shows the rollout in progress, then the new version
        publish(donefile, tmp_path, B2, 300_000)
        phases: set[str] = set()

        def watching() -> bool:
            # one read: the page may re-render in between
            shown: list[str | None] = browser.execute_script(
                "const r = document.getElementById('rollout');"
                " return [r.hidden ? null : document.getElementById('rollout-phase').textContent,"
                " document.getElementById('live').textContent];"
            )
            if shown[0] is not None:
                phases.add(shown[0])
            return shown[1] == B2

        assert poll_until(watching, WAIT, 0.05), (phases, text("problem"))
        assert phases, "the rollout was never shown in progress"
        assert phases <= {"build", "download", "reload", "enable"}, phases
        assert not browser.find_element(By.ID, "rollout").is_displayed()
        screenshot = tmp_path / "status-page.png"
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        # roll back from the page (the token it was given is used)
        def click_rollback() -> bool:
            try:  # the row may be re-rendered between finding the button and clicking it
                browser.find_element(By.XPATH, f"//button[text()='Roll back to {B1}']").click()
            except StaleElementReferenceException:
                return False
            return True

        assert poll_until(click_rollback, 20, 0.05)
        browser.switch_to.alert.accept()
        assert poll_until(lambda: text("live") == B1, WAIT, 0.1), text("problem")
        assert cluster.transfer_info()["live_version"] == B1  # the transfer agrees

        # after the rollback: B2, newer than the live B1, is rolled forward to; the history is
        # in time order (B1, B2, then the rollback); the replicas' Rollback_Succ is green like
        # Enable_Succ
        def after_rollback() -> list[Any]:  # [history rows, replica colours, two colours]
            answer: list[Any] = browser.execute_script(
                "const rows = [...document.querySelectorAll('#history tbody tr')];"
                " const colour = (cls) => { const td = document.createElement('td');"
                " td.className = cls; document.body.appendChild(td);"
                " const c = getComputedStyle(td).color; td.remove(); return c; };"
                " return [rows.map(r => [r.dataset.version, r.cells[1].textContent,"
                " r.querySelector('button') ? r.querySelector('button').textContent : '']),"
                " [...document.querySelectorAll('#replicas tbody td.Rollback_Succ')]"
                ".map(td => getComputedStyle(td).color),"
                " colour('Enable_Succ'), colour('Dead')];"
            )
            return answer

        def rolled_back() -> bool:
            rows, replicas, _, _ = after_rollback()
            return [r[1] for r in rows] == ["base", "base", "rollback"] and len(replicas) == 2

        assert poll_until(rolled_back, 20, 0.1), after_rollback()
        rows, replicas, enabled, dead = after_rollback()
        forward = f"Roll forward to {B2}"
        assert rows == [[B1, "base", ""], [B2, "base", forward], [B1, "rollback", ""]], rows
        assert enabled != dead and replicas == [enabled, enabled], (replicas, enabled, dead)

        # how long each took: the API's float seconds, not the whole ones of create_time and
        # finish_time
        def took_cells() -> list[list[str]]:  # [version, mode, took] per history row
            cells: list[list[str]] = browser.execute_script(
                "return [...document.querySelectorAll('#history tbody tr')].map(r =>"
                " [r.dataset.version, r.cells[1].textContent, r.cells[4].textContent]);"
            )
            return cells

        def took_as_the_api_says() -> bool:
            took = {(r["version"], r["mode"]): r["took"] for r in cluster.history()}
            cells = took_cells()
            return len(cells) == 3 and all(took_shown(took[v, m], c) for v, m, c in cells)

        assert poll_until(took_as_the_api_says, 20, 0.1), (took_cells(), cluster.history())
    finally:
        cluster.down(timeout=5.0)


@needs_chromium
def test_status_page_retries_an_abandoned_version(tmp_path: Path, browser: Chrome) -> None:
    """A base whose donefile line names an input folder that is not there (the trainer's copy
    never landed): every attempt fails, the version is abandoned and the page offers Retry.
    Once the input is written in place, Retry (confirmed) rolls it out: it goes live, on the
    page and in the transfer's API, and its history row offers Retry no more."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    donefile = tmp_path / "donefile"
    donefile.mkdir()
    retries = 1  # two attempts, the second 0.3 s after the first failed
    spec = ClusterSpec(
        dir=tmp_path / "cluster", shards=1, replicas=2, donefile=donefile, poll_interval=0.2,
        transfer_overrides={
            "api_token": TOKEN, "version_retries": retries, "version_retry_backoff": 0.3,
        },
    )  # fmt: skip
    cluster = up(spec)
    try:
        publish(donefile, tmp_path, B1, 2000)
        cluster.wait_version(B1, WAIT)
        missing = tmp_path / "input" / B2
        append_line(donefile / "base.txt", format_line(B2, B2, str(missing)))
        browser.get(f"{cluster.transfer_url}/?poll_ms=200")
        log_in(browser)

        def text(element_id: str) -> str:
            return browser.find_element(By.ID, element_id).text

        assert poll_until(lambda: text("live") == B1, 20, 0.1), text("problem")

        def history_rows() -> list[list[Any]]:  # [version, mode, status, attempts, message,
            # [button texts]] per row, read in one call (the page re-renders as it polls)
            rows: list[list[Any]] = browser.execute_script(
                "return [...document.querySelectorAll('#history tbody tr')].map(r =>"
                " [r.dataset.version, r.cells[1].textContent, r.cells[2].textContent,"
                " r.cells[3].textContent, r.cells[6].textContent,"
                " [...r.querySelectorAll('button')].map(b => b.textContent)]);"
            )
            return rows

        def row_of(version: str) -> list[Any]:
            return next((r for r in history_rows() if r[0] == version), [])

        # every attempt fails: the page shows B2 failed and abandoned, with its Retry button
        attempts = retries + 1
        retry_button = f"Retry {B2}"
        assert poll_until(lambda: retry_button in (row_of(B2) or [[]])[-1], WAIT, 0.1), (
            history_rows(), text("problem"))  # fmt: skip
        _, mode, status, tries, message, buttons = row_of(B2)
        assert (mode, status, tries) == ("base", "failed", f"{attempts} of {attempts}")
        assert f"{missing} does not exist" in message, message
        assert f"abandoned: gave up after {attempts} attempts" in message, message
        assert buttons == [retry_button], buttons
        assert not browser.find_element(By.ID, "retry").is_displayed()  # no retry to come
        assert text("live") == B1
        rec = next(r for r in cluster.history() if r["version"] == B2)
        assert (rec["status_str"], rec["attempts"], rec["retry_at"]) == ("failed", attempts, 0)
        assert rec["abandoned"] and "retry_requested" not in rec["times"], rec
        assert cluster.transfer_info()["live_version"] == B1

        # the input is written in place, then Retry on the page (the token it was given is
        # sent: the API refuses a POST without it)
        write_input(tmp_path, B2, 3000)

        def click_retry() -> bool:
            try:  # the row may be re-rendered between finding the button and clicking it
                browser.find_element(By.XPATH, f"//button[text()='{retry_button}']").click()
            except StaleElementReferenceException:
                return False
            return True

        assert poll_until(click_retry, 20, 0.05)
        alert = browser.switch_to.alert
        assert alert.text == f"Roll {B2} out again?"
        alert.accept()
        assert poll_until(lambda: text("live") == B2, WAIT, 0.1), (history_rows(), text("problem"))
        info = cluster.transfer_info()
        assert info["live_version"] == B2 and not info["awaiting_retry"], info
        rec = next(r for r in cluster.history() if r["version"] == B2)
        assert rec["status_str"] == "finished" and not rec["abandoned"], rec
        assert rec["attempts"] == 1 and "retry_requested" in rec["times"], rec

        # its history row (the same record, retried) is finished and offers Retry no more
        def retried() -> bool:
            rows = history_rows()
            return [r[:3] for r in rows] == [[B1, "base", "finished"], [B2, "base", "finished"]]

        assert poll_until(retried, 20, 0.1), history_rows()
        rows = history_rows()
        assert rows[1][3] == "" and rows[1][5] == [], rows  # one attempt, no button
        assert rows[0][5] == [f"Roll back to {B1}"], rows
        assert not any(b.startswith("Retry") for r in rows for b in r[5]), rows
        assert not browser.find_element(By.ID, "problem").is_displayed(), text("problem")
    finally:
        cluster.down(timeout=5.0)
