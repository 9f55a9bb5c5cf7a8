"""The page at / in headless Chromium against a real ``docqa serve``: a manual uploaded through
the page, two questions (the second reads its manual from the cache), a third cancelled
mid-stream, an upload error, the cold comparison and the engine panel; and with API keys on,
the key asked for, a wrong one refused, the right one used."""

from __future__ import annotations

import shutil
import time
import uuid

import pytest
from test_api import SAMPLE

pytestmark = pytest.mark.slow


def _chromium():
    """A headless Chromium through chromedriver (Debian's chromium and chromium-driver, which
    ``make install`` installs); fails, never skips, without them."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        raise RuntimeError("the browser test needs Chromium and chromedriver (make install)")
    opts = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1400,1000")
    opts.binary_location = browser
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


@pytest.fixture
def browser():
    d = _chromium()
    yield d
    d.quit()


def _wait(d, what, timeout: float = 120):
    """Poll ``what(d)`` until it is true; an element the page re-rendered meanwhile (the lists
    are rebuilt as they refresh) or not there yet is polled again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    ignored = (NoSuchElementException, StaleElementReferenceException)
    return WebDriverWait(d, timeout, poll_frequency=0.05, ignored_exceptions=ignored).until(
        lambda d: what(d)
    )


def _by(css: str):
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def _answers(d):
    return d.find_elements(*_by("li.answer"))


def _ask(d, question: str, max_tokens: int = 24) -> None:
    box = d.find_element(*_by("#max-tokens"))
    box.clear()
    box.send_keys(str(max_tokens))
    d.find_element(*_by("#question")).send_keys(question)
    d.find_element(*_by("#ask")).click()


def _finished(d, n: int):
    answers = _answers(d)
    return len(answers) >= n and answers[n - 1].get_attribute("data-finish-reason")


def _console_problems(d, expected_statuses: tuple[int, ...]) -> list[dict]:
    """Browser log entries that are errors: any from the page's scripts, and any failed load
    but the responses the test provoked on purpose."""
    out = []
    for entry in d.get_log("browser"):
        if entry["level"] != "SEVERE":
            continue
        expected = any(f"status of {s} " in entry["message"] for s in expected_statuses)
        if entry.get("source") == "network" and expected:
            continue
        out.append(entry)
    return out


def test_the_page_asks_streams_cancels_and_shows_what_the_cache_saved(
    sqlite_server, browser, tokenizer, tmp_path
):
    d = browser
    d.get(sqlite_server.url + "/")
    # upload a manual through the file picker
    manual = tmp_path / "washer.md"
    manual.write_text(f"Revision {uuid.uuid4().hex}\n\n{SAMPLE}")
    d.find_element(*_by("#file")).send_keys(str(manual))
    _wait(d, lambda d: "tokens" in d.find_element(*_by("#upload-status")).text)
    _wait(d, lambda d: d.find_element(*_by("#manual-list li.selected .title")).text == "washer")
    # two questions: the second reads the manual (and the first turn) from the cache
    _ask(d, "Which option compresses the archive?")
    _wait(d, lambda d: _finished(d, 1))
    second = "How do I keep existing files?"
    _ask(d, second)
    seen = set()  # the answer's text as it streams in
    _wait(d, lambda d: seen.add(_answers(d)[-1].text) or _finished(d, 2))
    answer = _answers(d)[1]
    prompt = int(answer.get_attribute("data-prompt-tokens"))
    cached = int(answer.get_attribute("data-cached-tokens"))
    before_question = prompt - len(tokenizer.encode(second))
    assert cached >= 0.95 * before_question, (cached, before_question)
    share = round(100 * cached / prompt)
    assert f"{cached:,} cached ({share}%" in answer.text
    assert "TTFT" in answer.text and "TPOT" in answer.text and "the cache saved" in answer.text
    assert "(estimated)" in answer.text  # how the saving was obtained: the cost model
    assert len(seen) > 2  # it grew token by token before the answer was whole
    # the manual's ledger in the list, refreshed after each answer (a read of the rebuilt
    # list is one poll)
    ledger = "#manual-list li.selected .ledger"
    _wait(d, lambda d: d.find_element(*_by(ledger)).text.startswith("2 answers"))
    assert "prompt tokens reused" in _wait(d, lambda d: d.find_element(*_by(ledger)).text)
    # the same question computed cold, beside it
    answer.find_element(*_by(".compare-button")).click()
    _wait(d, lambda d: answer.find_elements(*_by(".compare[data-cold-ttft]")))
    compare = answer.find_element(*_by(".compare")).text
    assert "as answered" in compare and "computed cold" in compare
    # a third, stopped mid-stream
    _ask(d, "Describe every option of tarx in detail.", max_tokens=400)
    _wait(d, lambda d: len(_answers(d)) == 3 and len(_answers(d)[2].text) > 20)
    d.find_element(*_by("#stop")).click()
    _wait(d, lambda d: _finished(d, 3))
    third = _answers(d)[2]
    assert third.get_attribute("data-finish-reason") == "cancelled"
    assert third.find_element(*_by(".badge.status")).text == "cancelled"
    # an empty file: the server's message
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    d.find_element(*_by("#file")).send_keys(str(empty))
    _wait(d, lambda d: "empty" in d.find_element(*_by("#upload-status")).text)
    status = d.find_element(*_by("#upload-status"))
    assert status.text == "empty.txt is empty" and "error" in status.get_attribute("class")
    # a manual dropped on the page (a drop event carrying a file), then deleted from the list
    d.execute_script(
        """
        const dt = new DataTransfer();
        dt.items.add(new File([arguments[0]], "dropped.txt", {type: "text/plain"}));
        document.getElementById("drop").dispatchEvent(
            new DragEvent("drop", {dataTransfer: dt, bubbles: true, cancelable: true}));
        """,
        f"Dropped manual {uuid.uuid4().hex}. Press START to begin.",
    )
    _wait(d, lambda d: "dropped:" in d.find_element(*_by("#upload-status")).text)
    # the list may be rebuilt by its refresh between any two reads: each read is one poll
    selected = "#manual-list li.selected"
    _wait(d, lambda d: d.find_element(*_by(f"{selected} .title")).text == "dropped")
    dropped_id = _wait(d, lambda d: d.find_element(*_by(selected)).get_attribute("data-manual-id"))

    def delete(d) -> bool:
        d.find_element(*_by(f"li[data-manual-id='{dropped_id}'] .delete")).click()
        return True

    _wait(d, delete)
    _wait(d, lambda d: not d.find_elements(*_by(f"li[data-manual-id='{dropped_id}']")))
    with sqlite_server.client() as c:
        assert c.get(f"/v1/manuals/{dropped_id}").status_code == 404
    # the engine panel, refreshed from /v1/engine and /metrics; the chart has its points
    _wait(d, lambda d: "Answers served" in d.find_element(*_by("#engine-stats")).text)
    stats = d.find_element(*_by("#engine-stats")).text
    assert "KV capacity" in stats and "Cache hit rate" in stats and "Concurrency at" in stats
    assert d.find_elements(*_by("#ttft-chart circle.warm"))
    assert d.find_elements(*_by("#ttft-chart circle.cold"))
    time.sleep(0.5)
    d.save_screenshot(str(tmp_path / "page.png"))
    assert (tmp_path / "page.png").stat().st_size > 10_000
    assert _console_problems(d, expected_statuses=(400,)) == []


def test_the_page_asks_for_a_key_and_refuses_a_wrong_one(pg_server, browser):
    d = browser
    d.get(pg_server.url + "/")
    status = d.find_element(*_by("#key-status"))
    _wait(d, lambda d: "needs an API key" in status.text)
    key = d.find_element(*_by("#api-key"))
    key.send_keys("not-a-key")
    d.find_element(*_by("#key-form button")).click()
    _wait(d, lambda d: "not valid" in status.text)
    assert "error" in status.get_attribute("class")
    assert d.find_elements(*_by("#manual-list li")) == []
    key.clear()
    key.send_keys("key-a")
    d.find_element(*_by("#key-form button")).click()
    _wait(d, lambda d: status.text == "key accepted")
    # tenant a's manuals only, and the key is kept for the next visit
    with pg_server.client("key-a") as a, pg_server.client("key-b") as b:
        mine = a.post("/v1/manuals", json={"title": "mine", "text": uuid.uuid4().hex}).json()
        theirs = b.post("/v1/manuals", json={"title": "theirs", "text": uuid.uuid4().hex}).json()
    d.refresh()
    _wait(d, lambda d: d.find_elements(*_by(f"li[data-manual-id='{mine['id']}']")))
    assert not d.find_elements(*_by(f"li[data-manual-id='{theirs['id']}']"))
    assert _console_problems(d, expected_statuses=(401,)) == []


def test_the_page_shows_a_long_manuals_parts_and_each_answers_part(
    sqlite_server, browser, tmp_path
):
    """A manual longer than the window: the list says how many parts and names them; an
    answer says which part it came from and which others ranked, and a runner-up asks again
    from that part; reopened, the stored turn still says which part answered."""
    from test_parts_api import TYPING

    d = browser
    d.get(sqlite_server.url + "/")
    manual = tmp_path / "typing.txt"
    manual.write_text(f"Revision {uuid.uuid4().hex}\n\n{TYPING}")
    d.find_element(*_by("#file")).send_keys(str(manual))
    _wait(d, lambda d: d.find_element(*_by("#manual-list li.selected .title")).text == "typing")
    manual_id = d.find_element(*_by("#manual-list li.selected")).get_attribute("data-manual-id")
    tokens = d.find_element(*_by("#manual-list li.selected .tokens")).text
    assert " parts" in tokens
    parts = d.find_elements(*_by("#manual-list li.selected details.parts li"))
    assert len(parts) >= 3
    _ask(d, "What does get_type_hints return?", max_tokens=4)
    _wait(d, lambda d: _finished(d, 1))
    line = _answers(d)[0].find_element(*_by(".part"))
    assert line.text.startswith("from part ") and f"of {len(parts)}: " in line.text
    assert "also ranked part" in line.text
    index = int(line.get_attribute("data-part"))
    # a runner-up part, one click: the same question answered from that part
    runner_up = line.find_element(*_by("button.ask-part"))
    other = int(runner_up.get_attribute("data-part"))
    assert other != index
    runner_up.click()
    _wait(d, lambda d: _finished(d, 2))
    assert int(_answers(d)[1].find_element(*_by(".part")).get_attribute("data-part")) == other
    # the stored turn, reopened, names the same part
    d.refresh()
    title = f'#manual-list > li[data-manual-id="{manual_id}"] .title'
    _wait(d, lambda d: d.find_element(*_by(title))).click()
    _wait(d, lambda d: _answers(d) and _answers(d)[0].find_elements(*_by(".part")))
    again = _answers(d)[0].find_element(*_by(".part"))
    assert int(again.get_attribute("data-part")) == index
    assert again.text.startswith(f"from part {index + 1} of {len(parts)}")
    assert not _console_problems(d, ())
