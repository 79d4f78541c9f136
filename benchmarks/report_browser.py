"""Open a kvfast report in headless Chromium, as a reader would, and check it.

    python benchmarks/report_browser.py results/reproduce.report/report.html [--screenshot PATH]

Loads the page from disk (a file:// URL, no server) and asserts: no failed
request (Network.loadingFailed, or an HTTP status >= 400), no console error,
no uncaught exception, no request that leaves the machine (every request is a
file: or data: URL), and every image present, decoded and non-empty (natural
size > 0). Then it saves a full-page screenshot (default: beside the report,
``report.png``). Exit 0 when every check passes, 1 otherwise (each failure
printed), 2 when no Chromium is found.

Chromium is driven over the DevTools protocol through a pipe
(``--remote-debugging-pipe``), so nothing beyond the standard library and a
Chromium binary is needed (Debian: ``apt-get install chromium``; or set
``CHROMIUM=/path/to/chrome``). Not part of the test suite, since CI has no browser.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def find_chromium() -> str | None:
    """The Chromium binary: ``$CHROMIUM``, else the first of :data:`CANDIDATES` on ``PATH``."""
    env = os.environ.get("CHROMIUM")
    if env:
        return env
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class DevTools:
    """A minimal DevTools-protocol client over Chromium's pipe (fd 3: commands in, fd 4: messages out)."""

    def __init__(self, binary: str, profile: str):
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def child_fds() -> None:
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args, pass_fds=(3, 4, to_chrome_r, from_chrome_w), preexec_fn=child_fds, stderr=subprocess.DEVNULL
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next = 0
        self.events: list[dict] = []

    def _read_message(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no message from Chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        """Send one command and return its result (events that arrive meanwhile are kept in ``events``)."""
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read_message(timeout)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 60) -> dict:
        """Wait for the event ``method`` (or return it if it already arrived)."""
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self._read_message(deadline - time.monotonic())
            self.events.append(e)
            if e.get("method") == method:
                return e
        raise TimeoutError(f"{method} did not arrive")

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


IMAGES_JS = """JSON.stringify({
  images: Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth,
                                                   h: i.naturalHeight, src: i.src.slice(0, 22)})),
  height: document.documentElement.scrollHeight, width: document.documentElement.scrollWidth,
  title: document.title, tables: document.querySelectorAll('table').length})"""


def viewport(height: int, width: int = 1300) -> dict:
    """DevTools metrics for a desktop viewport of ``width`` x ``height`` CSS pixels."""
    return {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}


def check_report(page: Path, screenshot: Path, binary: str) -> list[str]:
    """Open ``page``, run every check, save ``screenshot``; return the failures (empty: all passed)."""
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvfast-browser-") as profile:
        dt = DevTools(binary, profile)
        try:
            target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                dt.send(f"{domain}.enable", session=session)
            dt.send("Emulation.setDeviceMetricsOverride", viewport(900), session=session)
            dt.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
            dt.wait_for("Page.loadEventFired", timeout=120)
            info = json.loads(
                dt.send("Runtime.evaluate", {"expression": IMAGES_JS, "returnByValue": True}, session=session)[
                    "result"
                ]["value"]
            )
            dt.send("Emulation.setDeviceMetricsOverride", viewport(int(info["height"])), session=session)
            shot = dt.send(
                "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=session, timeout=120
            )
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        finally:
            dt.close()
    for e in dt.events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Network.loadingFailed":
            failures.append(f"failed request: {params.get('errorText')} ({params.get('requestId')})")
        elif method == "Network.responseReceived" and params.get("response", {}).get("status", 200) >= 400:
            failures.append(f"HTTP {params['response']['status']}: {params['response'].get('url', '')[:80]}")
        elif method == "Network.requestWillBeSent":
            url = params.get("request", {}).get("url", "")
            if not url.startswith(("file:", "data:")):
                failures.append(f"request leaves the disk: {url[:80]}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            failures.append(f"console {params['type']}: {json.dumps(params.get('args'))[:200]}")
        elif method == "Runtime.exceptionThrown":
            failures.append(f"uncaught exception: {params.get('exceptionDetails', {}).get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            failures.append(f"log error: {params['entry'].get('text', '')[:200]}")
    images = info["images"]
    if not images:
        failures.append("no image on the page")
    for img in images:
        if not img["complete"] or img["w"] <= 0 or img["h"] <= 0:
            failures.append(f"image not shown: {img['alt']!r} ({img['w']}x{img['h']}, src {img['src']}...)")
    if screenshot.stat().st_size == 0:
        failures.append("empty screenshot")
    sizes = ", ".join(f"{i['w']}x{i['h']}" for i in images)
    print(
        f"{page}: {len(images)} images ({sizes}), {info['tables']} tables, "
        f"page {info['width']}x{info['height']} px; screenshot {screenshot} ({screenshot.stat().st_size:,} bytes)"
    )
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="a report.html written by `kvfast report` or `kvfast reproduce`")
    p.add_argument("--screenshot", type=Path, help="PNG to write (default: report.png beside the report)")
    args = p.parse_args(argv)
    if not args.report.is_file():
        print(f"report: {str(args.report)!r} is not a file", file=sys.stderr)
        return 2
    binary = find_chromium()
    if binary is None:
        print("no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/chrome)", file=sys.stderr)
        return 2
    shot = args.screenshot or args.report.with_name("report.png")
    failures = check_report(args.report, shot, binary)
    for f in failures:
        print(f"FAIL {f}")
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
