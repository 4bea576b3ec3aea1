"""Open the built site in headless Chromium, as a reader would, and check what a reader needs (issue 39).

    python docs/gen/browser_check.py site [--screenshot site-check.png]

Serves the site on localhost (Material's search loads its index with fetch(), which file:// pages may not do),
renders the start page and the configuration reference with Chromium's --dump-dom (the DOM after the page's
scripts ran) and checks: the navigation lists the guide's sections, the search box is there and the search
index holds the configuration reference, the start page shows highlighted code blocks, and the reference shows
its key tables. Exit 1 with one line per problem. Chromium: Debian's package (`apt-get install chromium`).
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# Without the background-networking flags Chromium tries Google's hosts at every start, which a closed network
# refuses many times over; a fresh profile keeps runs independent.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--virtual-time-budget=5000"]
PAGES = {"start page": "index.html", "configuration reference": "reference/configuration.html"}
NAV_SECTIONS = ("Getting started", "Kinds of experiment", "How-to", "Reference")


def chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the check's own lines
        pass


def serve(site: Path) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def render(browser: str, url: str, *extra: str, timeout: int = 60) -> str:
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed on {url} (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout


def problems(site: Path, browser: str, screenshot: Path | None = None, pages: dict[str, str] = PAGES) -> list[str]:
    """What a reader would miss on the built ``site``; empty when the check passes."""
    found = []
    index = site / "search" / "search_index.json"
    if not index.exists():
        return [f"{index}: no search index (is the search plugin on?)"]
    documents = json.loads(index.read_text())["docs"]
    if not any(doc["location"].startswith("reference/configuration.html") and "max_length" in doc["text"]
               for doc in documents):
        found.append(f"{index}: the configuration reference's keys are not in the search index")
    server, base = serve(site)
    try:
        for name, page in pages.items():
            dom = render(browser, f"{base}/{page}", "--dump-dom")
            if 'class="md-nav' not in dom or not all(section in dom for section in NAV_SECTIONS):
                found.append(f"{page} ({name}): the navigation with {', '.join(NAV_SECTIONS)} is missing")
            if 'class="md-search' not in dom or "data-md-component=\"search-query\"" not in dom:
                found.append(f"{page} ({name}): no search box")
            if page == "index.html" and ('class="highlight' not in dom or "<code" not in dom):
                found.append(f"{page} ({name}): no highlighted code block")
            if page.startswith("reference/") and ("<table" not in dom or "training.max_length" not in dom):
                found.append(f"{page} ({name}): the key table (training.max_length) is missing")
        if screenshot is not None:
            render(browser, f"{base}/index.html", f"--screenshot={screenshot}", "--window-size=1280,1000")
            if not screenshot.exists() or screenshot.stat().st_size == 0:
                found.append(f"{screenshot}: no screenshot written")
    finally:
        server.shutdown()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--screenshot", type=Path)
    args = parser.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("error: no Chromium found; install it (apt-get install chromium)", file=sys.stderr)
        return 2
    found = problems(args.site, browser, args.screenshot)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    if not found:
        print(f"the site in {args.site} renders in {browser} with navigation, search and code blocks")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
