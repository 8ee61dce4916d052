"""The README says what the registry holds: its opening paragraph names as many families as
raydit.models.registry finds, its model table has one row per family listing that family's
pipeline classes and tiny built-ins (no more, no fewer), and its list of planner built-ins is
planner.BUILTIN_MODELS. Pure Python: no torch, no Ray."""

import re
from pathlib import Path

from raydit.models.registry import families
from raydit.planner import BUILTIN_MODELS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
NUMBERS = {6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}


def _table_rows() -> list[list[str]]:
    section = README.split("## Model families", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| family")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def _opening() -> str:
    return README.split("\n\n", 2)[1]  # the paragraph under the title


def test_the_model_table_has_a_row_per_family_with_its_pipelines_and_tiny_models():
    rows = _table_rows()
    found = families()
    assert len(rows) == len(found), [r[0] for r in rows]
    table_tiny = {name for row in rows for name in re.findall(r"`(tiny[\w-]*)`", row[-1])}
    registry_tiny = {name for family in found.values() for name in family.tiny()}
    assert table_tiny == registry_tiny
    for name, family in found.items():
        owners = [row for row in rows if set(family.tiny()) & set(re.findall(r"`(tiny[\w-]*)`", row[-1]))]
        assert len(owners) == 1, f"family {name}: its tiny models are in {len(owners)} rows"
        for pipeline in family.pipelines:
            assert f"`{pipeline}`" in owners[0][1], f"family {name}: {pipeline} not in its row"


def test_the_opening_paragraph_names_every_family():
    opening = _opening()
    count = len(families())
    assert f"{NUMBERS[count]} families" in opening, opening
    for row in _table_rows():
        title = re.split(r"[ (]", row[0])[0]  # "Wan 2.1 / 2.2" -> "Wan", "LTX-2" -> "LTX-2"
        assert title in opening, f"{title} is a family of the table, not of the opening paragraph"


def test_the_planner_builtins_listed_are_the_planner_s():
    listed = README.split("Planner built-ins:", 1)[1].split(". ", 1)[0]
    names = set(re.findall(r"`([\w.-]+)`", listed))
    assert names == {name for name in BUILTIN_MODELS if not name.startswith("tiny")}
