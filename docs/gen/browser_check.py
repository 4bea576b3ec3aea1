"""Open the built site in headless Chromium, as a reader would, and check what a reader needs.

    python docs/gen/browser_check.py site [--screenshot site-check.png] [--reference-screenshot reference-check.png]

Serves the site on localhost (Material's search loads its index with fetch(), which file:// pages may not do),
renders the start page and the configuration reference with Chromium's --dump-dom (the DOM after the page's
scripts ran) and checks: the navigation lists the guide's sections, the search box is there and the search
index holds the configuration reference, the start page shows highlighted code blocks, and the reference shows
its key tables; and in a 1280 px window, that every table of the reference fits the text column (no sideways
scrolling) and that no row of it is a tall band with no description (a section's row listing every stage of its
keys one per line). Exit 1 with one line per problem. Chromium: Debian's package (`apt-get install chromium`).
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
WINDOW = "1280,1000"  # a laptop's window: the reference's tables must fit its text column
# Measured in the page by the check's own server (never part of the site): each table of the article, its width
# against its column's, and its tallest row without a description (the fifth cell) with that row's key.
LAYOUT_PAGE = "reference/configuration.html"
LAYOUT_QUERY = "layout-check"
LAYOUT_SCRIPT = r"""<script>
window.addEventListener("load", () => {
  const lines = [];
  document.querySelectorAll("article table").forEach((table, index) => {
    const column = table.closest(".md-typeset__scrollwrap") || table.parentElement;
    let band = [0, ""];
    for (const row of Array.from(table.rows).slice(1)) {
      const cells = row.cells;
      if (cells.length > 4 && !cells[4].textContent.trim() && row.offsetHeight > band[0])
        band = [row.offsetHeight, cells[0].textContent.trim()];
    }
    lines.push([index, table.scrollWidth, column.clientWidth, band[0], band[1]].join("\t"));
  });
  const out = document.createElement("pre");
  out.id = "layout-check";
  out.textContent = lines.join("\n");
  document.body.appendChild(out);
});
</script>"""
# A row with no description taller than this is a band: the model section's row listing every stage of its keys
# was 312 px (the datasets section's 475); a section row whose name pattern wraps in the narrow column is ~150.
BAND_PX = 200


def chromium() -> str | None:
    return next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # one line per request would bury the check's own lines
        pass

    def do_GET(self):
        """A page asked with ``?layout-check`` comes with LAYOUT_SCRIPT before ``</body>`` (the files are not touched)."""
        path, _, query = self.path.partition("?")
        if query != LAYOUT_QUERY:
            return super().do_GET()
        page = Path(self.translate_path(path)).read_text(encoding="utf-8")
        body = page.replace("</body>", LAYOUT_SCRIPT + "</body>", 1).encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


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


def layout_problems(browser: str, base: str) -> list[str]:
    """The reference at 1280 px: each table within its column, and no tall row without a description."""
    import html
    import re

    dom = render(browser, f"{base}/{LAYOUT_PAGE}?{LAYOUT_QUERY}", "--dump-dom", f"--window-size={WINDOW}")
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', dom, re.DOTALL)
    if found is None:
        return [f"{LAYOUT_PAGE}: the layout could not be measured"]
    lines = [line.split("\t") for line in html.unescape(found.group(1)).splitlines() if line]
    out = []
    for index, width, column, band, key in lines:
        if int(width) > int(column) + 1:
            out.append(f"{LAYOUT_PAGE}: table {int(index) + 1} is {width} px wide in a {column} px column at "
                       f"{WINDOW.split(',')[0]} px: it scrolls sideways")
        if int(band) > BAND_PX:
            out.append(f"{LAYOUT_PAGE}: table {int(index) + 1}'s row {key} is {band} px tall with no description")
    return out if lines else [f"{LAYOUT_PAGE}: no table measured"]


def problems(site: Path, browser: str, screenshot: Path | None = None, pages: dict[str, str] = PAGES,
             reference_screenshot: Path | None = None) -> list[str]:
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
        found += layout_problems(browser, base)
        for shot, page in ((screenshot, "index.html"), (reference_screenshot, LAYOUT_PAGE)):
            if shot is not None:
                render(browser, f"{base}/{page}", f"--screenshot={shot}", f"--window-size={WINDOW}")
                if not shot.exists() or shot.stat().st_size == 0:
                    found.append(f"{shot}: no screenshot written")
    finally:
        server.shutdown()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", type=Path)
    parser.add_argument("--screenshot", type=Path, help="the start page at 1280 px")
    parser.add_argument("--reference-screenshot", type=Path, help="the configuration reference at 1280 px")
    args = parser.parse_args(argv)
    browser = chromium()
    if browser is None:
        print("error: no Chromium found; install it (apt-get install chromium)", file=sys.stderr)
        return 2
    found = problems(args.site, browser, args.screenshot, reference_screenshot=args.reference_screenshot)
    for line in found:
        print(f"error: {line}", file=sys.stderr)
    if not found:
        print(f"the site in {args.site} renders in {browser} with navigation, search and code blocks, and the "
              f"reference's tables fit a {WINDOW.split(',')[0]} px window")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
