"""Headless-browser test of the chat page `zerolayer serve` answers at `/` (driven by
scripts/test-chat-page, which starts the server with an API key).

In Debian's chromium through chromedriver (Selenium 4), against the real server and model:
  1. the page asks for the API key (the server answers 401 without it); the key entered is kept
     in localStorage and a reload uses it without asking again;
  2. a prompt is answered: streamed text appears in steps (seen growing while the request runs),
     then the time to first token and tokens/s are shown;
  3. Stop ends a long answer: the text stops growing, the answer is marked stopped, and the
     server logs the request as cancelled;
  4. HTML is shown as text: a user message with an <img onerror> and a model answer with HTML
     tags in it create no elements of their own, and no script runs;
  5. a screenshot is saved.
"""
import argparse
import json
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

ALLOWED_TAGS = {"DIV", "SPAN", "P", "BR", "STRONG", "EM", "CODE", "PRE", "BUTTON", "UL", "OL",
                "LI", "H2", "H3", "H4", "BLOCKQUOTE", "A"}


def log(msg):
    print(f"chat-page: {msg}", file=sys.stderr, flush=True)


def model_id(url, key):
    req = urllib.request.Request(url + "/v1/models", headers={"x-api-key": key})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def assistant_messages(d):
    return d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def last_answer(d):
    msgs = assistant_messages(d)
    return msgs[-1] if msgs else None


def text_of(el):
    return el.find_element(By.CSS_SELECTOR, ".body").get_attribute("textContent")


def send(d, text):
    box = d.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def idle(d):
    return d.find_element(By.ID, "stop").get_attribute("disabled") is not None


def wait_idle(d, timeout):
    WebDriverWait(d, timeout).until(lambda d: idle(d))


def watch_growth(d, count, seconds):
    """Samples the last answer's text length while the request runs; returns the lengths."""
    WebDriverWait(d, 30).until(lambda d: last_answer(d) is not None)
    lengths, deadline = [], time.time() + seconds
    while time.time() < deadline and len(set(l for l in lengths if l)) < count:
        lengths.append(len(text_of(last_answer(d))))
        if idle(d):
            break
        time.sleep(0.05)
    return lengths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--server-log", required=True)
    ap.add_argument("--screenshot", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    a = ap.parse_args()
    expected_model = model_id(a.url, a.api_key)

    opts = webdriver.ChromeOptions()
    opts.binary_location = a.chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1100,900"):
        opts.add_argument(arg)
    d = webdriver.Chrome(service=Service(a.chromedriver), options=opts)
    failures = []
    try:
        d.get(a.url + "/")
        # 1. The key: asked for, kept, reused.
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "settings").get_attribute("open") is not None)
        log("the settings dialog asks for the API key")
        d.find_element(By.ID, "api-key").send_keys(a.api_key)
        temp = d.find_element(By.ID, "temperature")
        temp.clear()
        temp.send_keys("0")
        max_tokens = d.find_element(By.ID, "max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("160")
        d.find_element(By.ID, "save-settings").click()
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "model").text == expected_model)
        stored = d.execute_script("return JSON.parse(localStorage.getItem('zerolayer.chat.apiKey'))")
        assert stored == a.api_key, f"key in localStorage: {stored!r}"
        d.refresh()
        WebDriverWait(d, 30).until(lambda d: d.find_element(By.ID, "model").text == expected_model)
        assert d.find_element(By.ID, "settings").get_attribute("open") is None, "asked for the key again"
        log(f"key kept in localStorage; after a reload the model is {expected_model!r} without asking")

        # 2. A streamed answer with its statistics.
        send(d, "Write a long story about a brave dragon who learns to fly. Use many chapters.")
        lengths = watch_growth(d, 4, 60)
        distinct = sorted(set(l for l in lengths if l))
        assert len(distinct) >= 3, f"the text did not appear in steps: {lengths}"
        log(f"streamed text seen growing: lengths {distinct[:6]}...")

        # 3. Stop.
        d.find_element(By.ID, "stop").click()
        wait_idle(d, 30)
        answer = last_answer(d)
        stopped_len = len(text_of(answer))
        time.sleep(1.5)
        assert len(text_of(last_answer(d))) == stopped_len, "the text kept growing after Stop"
        meta = answer.find_element(By.CSS_SELECTOR, ".meta").text
        assert "stopped" in meta, f"meta: {meta!r}"
        assert "first token" in meta and "tokens/s" in meta, f"meta: {meta!r}"
        log(f"stopped at {stopped_len} characters; meta: {meta}")

        # 4. HTML stays text: the user's and the model's.
        d.find_element(By.ID, "new-chat").click()
        send(d, '<img src=x onerror="window.__xss=1"><b id="user-bold">hi</b> Write a minimal '
                'HTML page with a button and a script tag.')
        WebDriverWait(d, 30).until(lambda d: last_answer(d) is not None)
        wait_idle(d, 180)
        answer = last_answer(d)
        body = text_of(answer)
        meta = answer.find_element(By.CSS_SELECTOR, ".meta").text
        assert "first token" in meta and "tokens/s" in meta, f"meta: {meta!r}"
        tags = set(d.execute_script(
            "return Array.from(document.querySelectorAll('#messages *')).map(e => e.tagName)"))
        assert tags <= ALLOWED_TAGS, f"elements from message text: {tags - ALLOWED_TAGS}"
        odd_buttons = d.execute_script(
            "return Array.from(document.querySelectorAll('#messages button'))"
            ".filter(b => b.className !== 'copy').length")
        assert odd_buttons == 0, "a button from message text"
        assert d.execute_script("return window.__xss === undefined"), "a script ran"
        assert not d.find_elements(By.ID, "user-bold"), "user HTML became an element"
        user = d.find_elements(By.CSS_SELECTOR, "#messages .msg.user")[-1].text
        assert user.startswith('<img src=x onerror="window.__xss=1">'), f"user text: {user!r}"
        assert "<" in body and ">" in body, f"the model wrote no HTML this time: {body!r}"
        log(f"HTML shown as text; model answer: {body[:120]!r}...; meta: {meta}")
        d.execute_script("document.getElementById('scroller').scrollTop = 0")
        d.save_screenshot(a.screenshot)
        log(f"screenshot: {a.screenshot}")
    except Exception as e:  # noqa: BLE001 - report every failure with a screenshot
        failures.append(repr(e))
        try:
            d.save_screenshot(a.screenshot)
        except Exception:  # noqa: BLE001
            pass
    finally:
        d.quit()

    # 3, server side: the stopped request was cancelled, its line has no prompt text.
    access = []
    with open(a.server_log, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if v.get("message") == "request" and v.get("route") == "messages":
                access.append(v)
    if not any(v.get("outcome") == "cancelled" for v in access):
        failures.append(f"no cancelled request in the server's access log: {access}")
    if any("dragon" in json.dumps(v) for v in access):
        failures.append("prompt text in the access log")
    if failures:
        for f in failures:
            log(f"FAIL: {f}")
        sys.exit(1)
    log("all checks passed")


if __name__ == "__main__":
    main()
