"""docs/reliability.md stays true to the code: its tolerance table is the tests' table, every test
file and script it names exists, and the README links it."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import TOLERANCES

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"


def test_tolerance_table_matches_conftest():
    text = DOC.read_text()
    table = text.split("<!-- tolerance-table")[1].split("\n\n")[0]
    rows = re.findall(r"^\| (float\w+|bfloat16) \| ([0-9.e-]+) \| ([0-9.e-]+) \|$", table, re.M)
    documented = {getattr(torch, name): (float(a), float(r)) for name, a, r in rows}
    assert documented == TOLERANCES


def test_named_files_exist():
    text = DOC.read_text()
    names = set(re.findall(r"`((?:tests|benchmarks|examples)/[\w/.]+\.py)`", text))
    names |= set(re.findall(r"python (?:-m pytest [^\n]*?)?((?:benchmarks|examples)/[\w/]+\.py)",
                            text))
    assert len(names) >= 10
    missing = sorted(n for n in names if not (REPO / n).is_file())
    assert not missing, missing


def test_readme_links_the_page():
    assert "(docs/reliability.md)" in (REPO / "README.md").read_text()


def test_gpu_results_section_present():
    assert "## GPU results" in DOC.read_text()
