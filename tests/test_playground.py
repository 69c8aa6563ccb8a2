"""The playground page in a real browser: Playwright (PyPI) driving Debian's chromium against a real
`loramux serve` on the tiny model with real adapters.

Set LORAMUX_PLAYGROUND_SHOTS=DIR to write a screenshot of each view there (docs/img/ holds the ones shown
in README.md and docs/playground.md).
"""

from __future__ import annotations

import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tinymodel import write_tiny_lora

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package: Playwright's own browser download is never used
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
KEY, ADMIN = "page-key", "page-admin-key"
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
TIMEOUT_MS = 120_000
SHOTS = os.environ.get("LORAMUX_PLAYGROUND_SHOTS")

sync_api = pytest.importorskip("playwright.sync_api")
if not CHROMIUM.exists():
    pytest.skip("the browser tests need Debian's chromium (apt-get install chromium)", allow_module_level=True)
sync_api.expect.set_options(timeout=TIMEOUT_MS)  # a busy 2-core machine: waits are for events, never timings


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("page-adapters")
    for i, name in enumerate(("s1", "s2", "spare"), 1):
        write_tiny_lora(d / f"{name}.gguf", seed=300 + i, rank=4, scale=0.5)
    return d


@pytest.fixture(scope="module")
def server(tiny_model: Path, adapters: Path) -> Iterator[dict]:
    """`loramux serve` as a user starts it: the tiny model, adapters s1 and s2, both keys; its banner."""
    port = _free_port()
    cmd = [sys.executable, "-m", "loramux", "serve", str(tiny_model), "--port", str(port), "--parallel", "4",
           "--slots", "4", "--n-ctx", "512", "--threads", "1", "--api-key", KEY, "--admin-api-key", ADMIN,
           "--adapter-dir", str(adapters), "--lora", f"s1={adapters / 's1.gguf'}",
           "--lora", f"s2={adapters / 's2.gguf'}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for ln in proc.stderr:  # type: ignore[union-attr]
            lines.put(ln)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    banner, deadline = [], time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ln = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if ln is None:
                break
            banner.append(ln)
            if ln.lstrip().startswith("help:"):
                break
        text = "".join(banner)
        m = re.search(r"page:\s+(http://127\.0\.0\.1:\d+/playground)", text)
        assert m, text
        yield {"url": m.group(1).removesuffix("/playground"), "page": m.group(1), "banner": text,
               "adapters": adapters}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=str(CHROMIUM), headless=True,
                                                    args=ARGS, viewport={"width": 1280, "height": 860})
        ctx.set_default_timeout(TIMEOUT_MS)
        yield ctx
        ctx.close()


@pytest.fixture()
def page(browser: object, server: dict) -> Iterator[object]:
    """The page opened and connected with the API key (typed in, as a user does); every request it makes
    is recorded, and every script error fails the test."""
    p = browser.new_page()
    requests: list[str] = []
    errors: list[str] = []
    p.on("request", lambda r: requests.append(r.url))
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.goto(server["page"])
    p.fill("#api-key", KEY)
    p.click("#connect")
    sync_api.expect(p.locator("#status")).to_contain_text("connected: ")
    p.requests = requests  # type: ignore[attr-defined]
    yield p
    assert not errors, errors
    assert all(u.startswith(server["url"] + "/") for u in requests), requests  # nothing from elsewhere
    assert not any(KEY in u or ADMIN in u for u in requests), requests  # keys never in a URL
    p.close()


def _shot(p: object, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        p.screenshot(path=str(Path(SHOTS) / f"playground-{name}.png"))


def _api(server: dict, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(server["url"] + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)


# --------------------------------------------------------------------------------------------- the page
def test_page_is_served_public_small_and_locked_down(server):
    """The banner prints the page's URL; the page and its assets need no key, carry the CSP, add up to
    under 300 KB and load nothing from elsewhere; the page's data route needs the key; `GET /` is still
    Ollama's probe answer."""
    assert f"page:    {server['page']}" in server["banner"]
    total = 0
    for path in ("/playground", "/playground/app.js", "/playground/app.css"):
        r = httpx.get(server["url"] + path)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
        total += len(r.content)
        if path == "/playground":
            html = r.text
            assert re.findall(r"<script[^>]*>", html) == ['<script src="/playground/app.js" defer>']
            assert re.findall(r'(?:src|href)="([^"]+)"', html) == ["/playground/app.css", "/playground/app.js"]
        else:
            assert not re.search(r"https?://(?!127)", r.text.split("placeholder")[0]), path
    assert total < 300_000, total
    assert httpx.get(server["url"] + "/playground/api/adapters").status_code == 401
    assert httpx.get(server["url"] + "/playground", headers={"Host": "evil.example"}).status_code == 421
    assert httpx.get(server["url"] + "/", headers={"Authorization": f"Bearer {KEY}"}).text == "Ollama is running"


def test_chat_with_an_adapter_streams_the_answer(page, server):
    """Pick adapter s1, set its scale, send a prompt: the streamed answer is the server's answer to the same
    request; the rendered prompt is what the chat template made of the conversation."""
    page.select_option("#chat-add", "s1")
    page.click("#chat-add-btn")
    page.fill("#chat-stack .member input", "0.75")
    page.fill("#chat-temp", "0")
    page.fill("#chat-max", "12")
    page.fill("#chat-input", "the cat sat")
    page.click("#chat-send")
    sync_api.expect(page.locator("#status")).to_have_text("done")
    shown = page.locator("#chat-log .msg.assistant .content").inner_text()
    want = _api(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the cat sat"}], "lora": [{"name": "s1", "scale": 0.75}],
        "temperature": 0, "max_tokens": 12}).json()["choices"][0]["message"]["content"]
    assert shown == want and want
    page.click("#chat-prompt-btn")
    sync_api.expect(page.locator("#chat-prompt")).to_contain_text("user\nthe cat sat<end_of_turn>")
    assert page.locator("#chat-prompt").inner_text().count("<start_of_turn>") == 3  # user, answer, next turn
    _shot(page, "chat")


def _add_set(page: object, names: list[tuple[str, float]]) -> None:
    page.click("#cmp-add-set")
    row = page.locator("#cmp-sets .set").last
    for name, scale in names:
        row.locator("select").select_option(name)
        row.get_by_role("button", name="Add adapter").click()
        row.locator(f'.member[data-name="{name}"] input').fill(str(scale))


def _compare(page: object, server: dict, sets: list[list[tuple[str, float]]], max_tokens: int) -> list[str]:
    """Run the compare view over the base and `sets`; returns the columns' texts after checking each equals
    the server's non-streamed fan-out answer (no token dropped or reordered)."""
    page.click("#tab-compare")
    page.locator("#cmp-sets").evaluate("e => e.replaceChildren()")
    for s in sets:
        _add_set(page, s)
    page.fill("#cmp-prompt", "the cat sat")
    page.fill("#cmp-max", str(max_tokens))
    page.click("#cmp-run")
    sync_api.expect(page.locator("#status")).to_contain_text("compared")
    cols = page.locator("#cmp-cols .col")
    assert cols.count() == len(sets) + 1
    texts = [cols.nth(i).locator(".out").inner_text() for i in range(cols.count())]
    api_sets = [{"name": "base", "lora": []}] + [{"lora": [{"name": n, "scale": s} for n, s in st]} for st in sets]
    want = _api(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "the cat sat"}], "adapter_sets": api_sets,
        "temperature": 0, "max_tokens": max_tokens}).json()["choices"]
    assert texts == [c["message"]["content"] for c in want]
    return texts


def test_compare_two_adapters_and_the_base_in_three_columns(page, server):
    """Three columns (base, s1, s2) stream together through fan-out and show different text; each column's
    stats line has its TTFT and tokens/s; the diff marks where s1 and s2 first depart from the base."""
    page.check("#cmp-diff")
    texts = _compare(page, server, [[("s1", 1.0)], [("s2", 1.0)]], 16)
    assert len(set(texts)) == 3, texts
    cols = page.locator("#cmp-cols .col")
    for i in range(3):
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens", cols.nth(i).locator(".stats").inner_text())
    for i in (1, 2):
        assert cols.nth(i).locator(".first-departure").count() == 1
        assert "departs at token" in cols.nth(i).locator(".stats").inner_text()
    assert cols.nth(0).locator(".departed").count() == 0
    _shot(page, "compare")


def test_compare_eight_sets_and_the_base_keeps_up_with_the_stream(page, server):
    """Nine columns at once, with log-probability shading: every column holds exactly the tokens the server
    generated for its set, in order."""
    page.click("#tab-compare")
    page.check("#cmp-shade")
    sets = [[("s1", s)] for s in (1.0, 0.5, -0.5)] + [[("s2", s)] for s in (1.0, 0.5, -0.5)] + \
        [[("s1", 1.0), ("s2", 1.0)], [("s1", 0.5), ("s2", -1.0)]]
    _compare(page, server, sets, 24)
    assert page.locator("#cmp-cols .out span[title^='p = ']").count() > 0


def test_adapters_view_admin_actions_need_the_admin_key(page, server):
    """The Adapters view lists what the server holds; unloading without the admin key is refused by the page,
    with a wrong one by the server (nothing changes either time); with the key, load and unload work."""
    page.click("#tab-adapters")
    row = page.locator('#ad-table tr[data-name="s2"]')
    sync_api.expect(row).to_be_visible()
    cells = row.locator("td")
    assert cells.nth(2).inner_text() == "4" and cells.nth(3).inner_text() == "14"  # rank, targets
    assert re.fullmatch(r"[0-9a-f]{12}", cells.nth(5).inner_text())
    assert cells.nth(6).inner_text() in ("slot", "warm", "loaded") and cells.nth(7).inner_text() == "yes"
    row.get_by_role("button", name="unload s2").click()
    sync_api.expect(page.locator("#ad-msg")).to_contain_text("refused: this needs the admin key")
    page.fill("#admin-key", "wrong-key")
    row.get_by_role("button", name="unload s2").click()
    sync_api.expect(page.locator("#ad-msg")).to_contain_text("refused by the server: 401")
    assert _api(server, "/v1/unload_lora_adapter", {"lora_name": "s2"}).status_code == 403  # the API key alone
    sync_api.expect(row).to_be_visible()
    page.fill("#admin-key", ADMIN)
    page.fill("#ad-name", "spare")
    page.fill("#ad-source", str(server["adapters"] / "spare.gguf"))
    page.click("#ad-load-btn")
    sync_api.expect(page.locator("#ad-msg")).to_contain_text("loaded spare")
    sync_api.expect(page.locator('#ad-table tr[data-name="spare"]')).to_be_visible()
    _shot(page, "adapters")
    page.locator('#ad-table tr[data-name="spare"]').get_by_role("button", name="unload spare").click()
    sync_api.expect(page.locator("#ad-msg")).to_have_text("unloaded spare")
    sync_api.expect(page.locator('#ad-table tr[data-name="spare"]')).to_have_count(0)
    names = [m["id"] for m in httpx.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
             .json()["data"]]
    assert "spare" not in names and "s2" in names


def test_an_answer_with_html_is_shown_as_text(page):
    """A grammar makes the model answer with an <img onerror> and a <script>: the page shows them as text
    (no element is made from them, nothing of them runs)."""
    payload = "<img src=x onerror=\"document.title='pwned'\"><script>document.title='pwned'</script><b>bold</b>"
    gbnf = 'root ::= "' + payload.replace('"', '\\"') + '"'
    page.click("#tab-chat")
    page.fill("#chat-temp", "0")
    page.fill("#chat-max", "200")
    page.select_option("#chat-constraint", "grammar")
    page.fill("#chat-grammar", gbnf)
    page.fill("#chat-input", "hello world")
    page.click("#chat-send")
    sync_api.expect(page.locator("#status")).to_have_text("done")
    log = page.locator("#chat-log")
    assert log.locator(".msg.assistant .content").inner_text() == payload
    assert log.locator("img, script, b").count() == 0
    assert page.title() == "loramux playground"


def test_the_page_works_with_the_keyboard_alone(browser, server):
    """Keys typed, views switched with the arrow keys, an adapter added and a message sent, without a click."""
    p = browser.new_page()
    try:
        p.goto(server["page"])
        kb = p.keyboard

        def tab_to(selector: str, limit: int = 60) -> None:
            for _ in range(limit):
                kb.press("Tab")
                if p.evaluate(f"document.activeElement === document.querySelector('{selector}')"):
                    return
            pytest.fail(f"Tab never reached {selector}")
        tab_to("#api-key")
        kb.type(KEY)
        kb.press("Enter")
        sync_api.expect(p.locator("#status")).to_contain_text("connected: ")
        tab_to("#tab-chat")
        kb.press("ArrowRight")
        assert p.evaluate("document.activeElement.id") == "tab-compare"
        sync_api.expect(p.locator("#view-compare")).to_be_visible()
        kb.press("End")
        sync_api.expect(p.locator("#view-server")).to_be_visible()
        kb.press("Home")
        sync_api.expect(p.locator("#view-chat")).to_be_visible()
        tab_to("#chat-add")
        kb.press("ArrowDown")  # s1 → s2
        tab_to("#chat-add-btn")
        kb.press("Enter")
        sync_api.expect(p.locator('#chat-stack .member[data-name="s2"]')).to_have_count(1)
        tab_to("#chat-input")
        kb.type("hello world")
        kb.press("Control+Enter")
        sync_api.expect(p.locator("#status")).to_have_text("done")
        assert p.locator("#chat-log .msg.assistant .content").inner_text()
    finally:
        p.close()


def test_server_view_draws_live_metrics(page, server):
    """The Server view reads /metrics every few seconds: after traffic its throughput and per-adapter request
    rates show numbers, and the charts are drawn."""
    page.click("#tab-server")
    sync_api.expect(page.locator("#v-queue")).to_have_text(re.compile(r"^\d+ / \d+$"))
    for _ in range(3):
        _api(server, "/v1/completions", {"prompt": "the dog", "max_tokens": 8, "model": "s1", "ignore_eos": True})
    sync_api.expect(page.locator("#v-adapters")).to_contain_text("s1 ", timeout=30_000)
    sync_api.expect(page.locator("#v-tps")).not_to_have_text("–")
    painted = page.evaluate("""() => { const c = document.getElementById('ch-tps');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }""")
    assert painted > 100
    _shot(page, "server")
