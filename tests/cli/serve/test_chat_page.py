"""The chat page at / streams a reply into the page, in headless Chromium (Debian's `chromium`; skipped where it
is absent). The browser is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
ending in NUL on file descriptors 3 and 4), so no driver package is needed: the page is opened with ?q= (it asks
at once) and read until the reply is done, noting that its text grew while it streamed."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.cli.serve.conftest import KEY

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class DevTools:
    """A headless Chromium and its DevTools pipe: `call` sends a command and returns its result."""

    def __init__(self, url: str) -> None:
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()
        self.profile = tempfile.mkdtemp(prefix="ggrun-chromium-")

        def fds() -> None:  # the child's fd 3 reads our commands, fd 4 writes its answers (kept: pass_fds)
            a, b = fcntl.fcntl(to_child, fcntl.F_DUPFD, 10), fcntl.fcntl(from_child, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", url],
            pass_fds=(3, 4), preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buf = b""
        self._id = 0

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise AssertionError("chromium closed its DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._w)
        os.close(self._r)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)")
def test_the_chat_page_streams_a_reply(server):
    browser = DevTools(f"{server.url}/?q=Hello%2C%20who%20are%20you%3F&key={KEY}")
    try:
        page = _page_session(browser)
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            state = browser.call("Runtime.evaluate", page, returnByValue=True, expression=(
                "(() => { const b = document.querySelector('.msg.assistant, .msg.error');"
                " return b ? [b.className, b.dataset.state, b.textContent] : null; })()"))["result"].get("value")
            if state:
                seen.append(state)
                if state[1] == "done":
                    break
            time.sleep(0.02)
    finally:
        browser.close()
    assert seen and seen[-1][1] == "done", seen[-1:]
    cls, _, text = seen[-1]
    assert cls == "msg assistant" and text.strip()
    partial = {t for c, s, t in seen if s == "streaming" and t}
    assert partial and all(text.startswith(t) for t in partial)  # the text grew while the reply streamed


def _page_session(browser: DevTools) -> str:
    """The DevTools session of the page the browser opened."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pages = [t for t in browser.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        if pages:
            return browser.call("Target.attachToTarget", targetId=pages[0]["targetId"], flatten=True)["sessionId"]
        time.sleep(0.1)
    raise AssertionError("chromium opened no page")
