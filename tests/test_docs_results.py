"""Every result file the README and docs name exists in benchmarks/results/: a figure that
names its record must be able to show it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

RESULT_PATH = re.compile(r"benchmarks/results/([\w.-]+\.json)")
BARE_JSON = re.compile(r"(?<![\w/.-])([\w.-]+\.json)\b")


def result_prefixes() -> set[str]:
    """What result files start with (``serving``, ``decode_roofline``, ...): a bare name with
    one of these before its first '-' is a result file too."""
    return {path.name.split("-", 1)[0] for path in RESULTS.glob("*.json") if "-" in path.name}


def named_result_files(text: str, prefixes: set[str]) -> set[str]:
    names = set(RESULT_PATH.findall(text))
    names |= {name for name in BARE_JSON.findall(text) if "-" in name and name.split("-", 1)[0] in prefixes}
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_result_file_named_exists(doc: Path) -> None:
    missing = sorted(name for name in named_result_files(doc.read_text(), result_prefixes())
                     if not (RESULTS / name).is_file())
    assert not missing, f"{doc.name} names result files that benchmarks/results/ lacks: {missing}"


def test_the_check_finds_both_spellings() -> None:
    text = ("see `benchmarks/results/serving-x.json`, and decode_roofline-y.json beside it; "
            "multi_lora.json and config.json are not results")
    assert named_result_files(text, {"serving", "decode_roofline"}) == {"serving-x.json", "decode_roofline-y.json"}
