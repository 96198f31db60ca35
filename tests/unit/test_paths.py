"""safe_child keeps user-supplied names inside their folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from modules.paths import UnsafePath, safe_child


@pytest.mark.parametrize("name", ["", " ", "..", "../x", "a/../../x", "/etc/passwd", "x\x00y"])
def test_refuses_escapes(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafePath):
        safe_child(tmp_path, name)


def test_accepts_names_and_subfolders(tmp_path: Path) -> None:
    assert safe_child(tmp_path, "a.yaml") == tmp_path / "a.yaml"
    assert safe_child(tmp_path, "sub/b.gguf") == tmp_path / "sub" / "b.gguf"
    assert safe_child(tmp_path, "sub/../c") == tmp_path / "c"


def test_follows_links_the_user_placed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link.bin").symlink_to(outside)
    assert safe_child(root, "link.bin").read_bytes() == b"x"


def test_generated_images_are_served_by_id_only(hub: object) -> None:
    """/v1/images/files/{name}: only ``32 hex digits + .png`` inside the images folder, whatever the name holds."""
    import pytest

    from extensions.image_generation import generator
    from modules.errors import ModelNotFound

    good = "0123456789abcdef0123456789abcdef.png"
    assert generator.image_path(good) == generator.images_dir() / good
    for name in ("../secret.png", "..\\secret.png", "/etc/passwd", "..", good.upper(), good + "/../../x.png", ""):
        with pytest.raises(ModelNotFound, match="no image named"):
            generator.image_path(name)
