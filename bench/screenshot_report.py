"""Open a kvbench report.html in headless Chromium and save a screenshot (the check that the report renders
in a real browser with no network: tables and embedded plots).

    python bench/screenshot_report.py RESULTS_DIR [--out DIR] [--png report.png] [--size 1400,2000]

Writes the report (kvbench-report RESULTS_DIR --out DIR, default RESULTS_DIR/report) unless --html names an
existing report.html, then runs Chromium (`chromium` from Debian: apt-get install -y chromium; or $CHROMIUM) with
networking disabled and prints the PNG's path and size as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's kvbench


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise SystemExit("screenshot_report: no chromium found (apt-get install -y chromium, or set $CHROMIUM)")


def screenshot(html_path: str, png_path: str, size: str = "1400,2000", timeout: int = 120) -> None:
    """Chromium --headless --screenshot of file://html_path, with a throwaway profile and no network access."""
    profile = tempfile.mkdtemp(prefix="kvbench-chromium-")
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
           "--proxy-server=127.0.0.1:9",  # anything the page tried to fetch would fail (it should fetch nothing)
           f"--screenshot={os.path.abspath(png_path)}", f"--window-size={size}",
           "file://" + os.path.abspath(html_path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if proc.returncode != 0 or not os.path.isfile(png_path):
        raise SystemExit(f"screenshot_report: chromium failed ({proc.returncode}): {proc.stderr[-2000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results_dir", nargs="?", help="results folder to report on")
    p.add_argument("--out", help="report folder (default RESULTS_DIR/report)")
    p.add_argument("--experiment", help="only this experiment")
    p.add_argument("--html", help="an existing report.html (skip writing the report)")
    p.add_argument("--png", default="report.png", help="screenshot path (default report.png)")
    p.add_argument("--size", default="1400,2000", help="window size W,H (default 1400,2000)")
    args = p.parse_args()
    html = args.html
    if html is None:
        if not args.results_dir:
            p.error("give RESULTS_DIR or --html")
        from kvbench.reporting.report import write_report

        html = write_report(args.results_dir, args.out, args.experiment)["html"]
    screenshot(html, args.png, args.size)
    print(json.dumps({"html": os.path.abspath(html), "png": os.path.abspath(args.png),
                      "png_bytes": os.path.getsize(args.png)}))


if __name__ == "__main__":
    sys.exit(main())
