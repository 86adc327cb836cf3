from __future__ import annotations

from pathlib import Path

import pytest

from mixprec.doctor import check_file

from .cases import write


def test_python_tags_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "created"
    path = write(tmp_path, f"precision: !!python/object/apply:os.mkdir ['{marker}']\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        check_file(path)
    assert not marker.exists()
