"""Render the findings pages from the committed studies' JSON: docs/results.md and README.md's results section.

    python scripts/render_findings.py           # write the pages that differ
    python scripts/render_findings.py --check   # exit 1 naming the pages that differ (what the test suite checks)

Templates: docs/findings/*.md, Jinja2 (scripts/findings.py says what they may name). A number in a finding is never
typed: edit a template, or commit a study's JSON, then render.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    from findings import render_pages

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page differs")
    args = parser.parse_args(argv)
    try:
        pages = render_pages(ROOT, write=not args.check)
    except ValueError as error:  # a damaged study file, or a finding its data no longer carries: one line
        print(f"render_findings: error: {error}", file=sys.stderr)
        return 2
    stale = [page for page, text in pages.items() if (ROOT / page).read_text() != text]
    for page in stale:
        print(f"{page} differs from what its template and the committed JSON render", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
