"""The tests tree's own rules (README, "The tests mirror the package"): no test module imports
another (shared code is a fixture in conftest.py or a plain module such as tests/support/), and
no file is named after the audit that found its cases rather than what it tests."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
IMPORT_OF_A_TEST = re.compile(r"^\s*(?:from|import)\s+(?:tests\.|[\w.]*\btest_\w*)", re.MULTILINE)


def test_no_test_module_imports_another():
    found = [f"{path.relative_to(TESTS)}: {match.group(0).strip()}"
             for path in sorted(TESTS.rglob("*.py"))
             for match in IMPORT_OF_A_TEST.finditer(path.read_text())]
    assert not found, "move what they share into conftest.py or tests/support/:\n" + "\n".join(found)


def test_no_file_is_named_after_an_audit():
    audits = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("*_audit.py"))
    assert not audits, f"name these after the module they test: {audits}"
