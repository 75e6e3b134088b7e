"""The dashboard in a real browser (Debian's Chromium, driven by Playwright) against a
running cluster: asks for the API key, sees every machine, previews and launches a
pipeline instance, chats with it, stops a long answer, shows a narrow dark page, deletes
the instance, and sees a killed machine leave. Screenshots go to OUT.

usage: dashboard.py BASE_URL API_KEY MODEL MACHINES KILL_PID OUT
"""

import json
import os
import signal
import sys
import time
import urllib.request

from playwright.sync_api import expect, sync_playwright

BASE, KEY, MODEL, MACHINES, KILL_PID, OUT = sys.argv[1:7]
MACHINES, KILL_PID = int(MACHINES), int(KILL_PID)
os.makedirs(OUT, exist_ok=True)

# As root, in a closed network: no sandbox, and none of Chromium's own traffic.
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def step(what):
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def shot(page, name):
    path = os.path.join(OUT, name)
    page.screenshot(path=path, full_page=True)
    print(f"screenshot {path}", flush=True)


def status():
    req = urllib.request.Request(f"{BASE}/v1/status", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def wait_until(what, check, within):
    deadline = time.time() + within
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {within} s")


with sync_playwright() as p:
    browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    step("the page asks for the key once")
    page.goto(BASE + "/")
    page.get_by_test_id("key-input").fill(KEY)
    page.get_by_test_id("key-ok").click()

    step("markdown: code blocks and lists render; markup in an answer stays text")
    html = page.evaluate("""async () => {
        const m = await import('/ui/markdown.js');
        return m.render('# Title\\n\\n- one `x<y`\\n- **two**\\n\\n```rust\\nfn main() {}\\n```\\n<img src=x onerror=alert(1)>');
    }""")
    assert '<pre><code class="language-rust">fn main() {}</code></pre>' in html, html
    assert "<li>one <code>x&lt;y</code></li><li><strong>two</strong></li>" in html, html
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html, html

    step(f"the topology shows {MACHINES} machines and a master")
    expect(page.get_by_test_id("machine")).to_have_count(MACHINES, timeout=30_000)
    expect(page.locator(".badge.master")).to_have_count(1, timeout=10_000)
    expect(page.get_by_test_id("summary")).to_contain_text(f"{MACHINES} machines")
    shot(page, "01-machines.png")

    step("placement previews a pipeline over every machine, with each one's memory")
    page.get_by_test_id("place-model").select_option(MODEL)
    page.get_by_test_id("place-strategy").select_option("pipeline")
    page.get_by_test_id("place-ranks").select_option(str(MACHINES))
    page.get_by_test_id("preview").click()
    plan = page.locator(f'[data-testid=plan][data-strategy=pipeline][data-ranks="{MACHINES}"]')
    expect(plan).to_have_count(1, timeout=15_000)
    expect(plan.locator("tbody tr")).to_have_count(MACHINES)
    expect(plan).to_contain_text("MiB")
    shot(page, "02-plans.png")

    step("launch it and wait until it is ready")
    plan.get_by_test_id("launch").click()
    expect(page.get_by_test_id("place-note")).to_contain_text("Placed", timeout=15_000)
    instance = page.locator("[data-testid=instance]").filter(has_text=MODEL)
    expect(instance).to_have_count(1, timeout=10_000)
    expect(instance.locator("tbody tr")).to_have_count(MACHINES)
    shot(page, "03-instance-starting.png")
    expect(instance).to_have_attribute("data-state", "ready", timeout=120_000)
    models = page.locator(f'[data-testid=model-row][data-model="{MODEL}"]')
    expect(models.get_by_test_id("installed")).to_have_count(MACHINES, timeout=10_000)
    shot(page, "04-instance-ready.png")

    step("a chat message is answered, streamed, with its timings")
    page.get_by_test_id("chat-model").select_option(MODEL)
    page.get_by_test_id("chat-input").fill("What is the capital of France? Answer in one word.")
    page.get_by_test_id("send").click()
    answer = page.get_by_test_id("answer").last
    expect(answer).to_have_attribute("data-state", "done", timeout=60_000)
    text = answer.locator(".body").inner_text()
    assert text.strip(), "an empty answer"
    expect(answer.get_by_test_id("chat-stats")).to_contain_text("first token")
    expect(answer.get_by_test_id("chat-stats")).to_contain_text("tok/s")
    print(f"answer: {text!r}; {answer.get_by_test_id('chat-stats').inner_text()}", flush=True)
    shot(page, "05-chat.png")

    step("stop ends a long answer: the stream stops and the node frees the sequence")
    page.get_by_test_id("chat-max-tokens").fill("1500")
    page.get_by_test_id("chat-input").fill("Write a very long story about a lighthouse keeper, with many chapters.")
    page.get_by_test_id("send").click()
    long = page.get_by_test_id("answer").last
    wait_until("the long answer streams", lambda: len(long.locator(".body").inner_text()) > 40, 60)
    page.get_by_test_id("stop").click()
    expect(long).to_have_attribute("data-state", "stopped", timeout=5_000)
    stopped_at = len(long.locator(".body").inner_text())
    expect(page.get_by_test_id("stop")).to_be_disabled()

    def idle():
        serving = status().get("serving", [])
        return all(s["running"] == 0 and s["prefilling"] == 0 and s["waiting"] == 0 for s in serving)

    wait_until("the instance drops the cancelled sequence", idle, 10)
    page.wait_for_timeout(1000)
    after = len(long.locator(".body").inner_text())
    assert after == stopped_at, f"the answer grew after stop: {stopped_at} → {after}"
    print(f"stopped after {stopped_at} characters", flush=True)
    shot(page, "06-stopped.png")

    step("the throughput chart has the model")
    expect(page.get_by_test_id("throughput")).to_contain_text(MODEL, timeout=15_000)

    step("375 px wide in dark mode: usable, nothing wider than the screen")
    narrow = browser.new_context(viewport={"width": 375, "height": 800}, color_scheme="dark")
    narrow.add_init_script(f"localStorage.setItem('shoal-api-key', {json.dumps(KEY)})")
    small = narrow.new_page()
    small.on("pageerror", lambda e: errors.append(str(e)))
    small.goto(BASE + "/")
    expect(small.get_by_test_id("machine")).to_have_count(MACHINES, timeout=30_000)
    expect(small.get_by_test_id("instance")).to_have_count(1, timeout=10_000)
    width = small.evaluate("document.documentElement.scrollWidth")
    assert width <= 375, f"the page is {width} px wide at 375"
    bg = small.evaluate("getComputedStyle(document.body).backgroundColor")
    rgb = [int(c) for c in bg[bg.index("(") + 1 : bg.index(")")].split(",")[:3]]
    assert sum(rgb) < 150, f"not dark in dark mode: {bg}"
    for testid in ("send", "preview", "chat-input"):
        box = small.get_by_test_id(testid).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 375, f"{testid} off screen: {box}"
    shot(small, "07-narrow-dark.png")
    narrow.close()

    step("delete asks once more, then the instance is gone from the page and the cluster")
    instance.get_by_test_id("delete").click()
    expect(instance.get_by_test_id("delete")).to_have_text("Really delete?")
    instance.get_by_test_id("delete").click()
    expect(page.get_by_test_id("instance")).to_have_count(0, timeout=15_000)
    assert not status()["instances"], status()["instances"]

    step("a killed machine leaves the topology")
    os.kill(KILL_PID, signal.SIGKILL)
    t0 = time.time()
    expect(page.get_by_test_id("machine")).to_have_count(MACHINES - 1, timeout=30_000)
    print(f"the killed machine left the page after {time.time() - t0:.1f} s", flush=True)
    shot(page, "08-machine-left.png")

    assert not errors, f"errors in the page: {errors}"
    browser.close()
print("dashboard: all checks passed", flush=True)
