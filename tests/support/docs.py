"""What the documentation promises, read back for contract tests."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).parent.parent.parent / "docs"


def documented_metrics() -> set[str]:
    """Metric family names docs/metrics.md lists (suffixes stripped)."""
    names = set(re.findall(r"`(kvroute_[a-z0-9_]+)`", (DOCS / "metrics.md").read_text()))
    return {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in names}
