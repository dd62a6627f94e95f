"""The CLI's text output fits ``COLUMNS``, else 80 when piped: tests run piped, without ``COLUMNS``
from the shell that started them, so every run sees the same 80-column layout."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
