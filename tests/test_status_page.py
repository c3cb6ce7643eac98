"""cube-transfer's status page in a real headless browser (Debian's chromium through
selenium) against a live local cluster: the token prompt, a rollout shown in progress and then
the new version, the rollback button (and, after it, the roll-forward one), the history in time
order with how long each version took, and a screenshot written by the test. The page's pure
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


def publish(donefile: Path, root: Path, version: str, n: int) -> None:
    keys = np.arange(1, n + 1, dtype=np.uint64)
    values = np.random.default_rng(int(version) % 97).standard_normal((n, 16)).astype(np.float32)
    source = root / "input" / version
    source.mkdir(parents=True)
    with SequenceFileWriter(source / "part-00000") as writer:
        writer.write_batch(keys, ValueColumn.fixed(values.view(np.uint8).reshape(-1), 64))
    append_line(donefile / "base.txt", format_line(version, version, str(source)))


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
