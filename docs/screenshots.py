"""Screenshots of the built documentation site in headless Chromium: the home, guide, reference
and leaderboard pages, as PNGs to look at (links, maths, scrolling tables, figures).

    python docs/screenshots.py [SITE] [OUT]     # defaults: build/site build/screenshots

`make screenshots` builds the site first; `make chromium` installs Debian's browser. Exits 2
with one sentence where no Chromium is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: (PNG name, page of the site, window height): the pages a first reader opens
PAGES = [
    ("home", "index.html", 2400),
    ("guide", "guide.html", 2400),
    ("reference", "reference/attention.html", 2400),
    ("normalizers", "normalizers.html", 1600),
    ("leaderboard", "leaderboard.html", 5600),
]
WIDTH = 1280


def chromium() -> str | None:
    """The headless browser's executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(browser: str, page: Path, png: Path, height: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{height}",
                f"--screenshot={png}",
                page.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


def _refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def main(site: Path, out: Path) -> list[Path]:
    browser = chromium()
    if browser is None:
        _refuse("No Chromium found: install Debian's (`make chromium`) to take the screenshots.")
    if not (site / "index.html").is_file():
        _refuse(f"No site in {site}: build it first (`make docs`).")
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for name, page, height in PAGES:
        png = out / f"{name}.png"
        screenshot(browser, site / page, png, height)
        pngs.append(png)
        print(png)
    return pngs


if __name__ == "__main__":
    args = sys.argv[1:]
    site = Path(args[0]) if args else ROOT / "build" / "site"
    out = Path(args[1]) if len(args) > 1 else ROOT / "build" / "screenshots"
    main(site, out)
