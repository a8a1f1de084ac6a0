"""The torture script's CPU run: every case as expected on simulated streams (the GPU run uses the real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu import torture

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_torture_cases_all_as_expected_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "torture.json"
    assert torture.main(["--device", "cpu", "--steps", "30", "--json", str(out), "--root", str(tmp_path)]) == 0
    assert out.read_text().count('"ok": true') == 12
