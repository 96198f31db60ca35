"""The suite's own scheduling hint: the long files that make test's workers take first still exist."""

from __future__ import annotations

from tests.conftest import LONG_FILES, ROOT


def test_every_long_file_is_a_test_file_of_the_suite() -> None:
    missing = [name for name in LONG_FILES if not (ROOT / "tests" / name).is_file()]
    assert not missing, f"tests/conftest.py LONG_FILES names files that are gone: {missing}"
    assert len(set(LONG_FILES)) == len(LONG_FILES)
