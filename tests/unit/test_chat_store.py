"""Chat histories on disk, characters and TavernAI/SillyTavern cards."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from modules.chat import characters, history
from modules.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[2]


def make_conv(n: int = 4) -> history.Conversation:
    conv = history.new_conversation("Assistant")
    for i in range(n):
        conv.messages.append(
            {
                "role": "user" if i % 2 == 0 else "assistant",
                "content": f"message {i} about lighthouses" if i == 2 else f"message {i}",
            }
        )
    return conv


def test_save_list_load_search_rename_delete(hub: object, user_data: Path) -> None:
    a = make_conv()
    history.save(a)
    time.sleep(0.01)
    b = history.new_conversation("Assistant")
    b.messages = [{"role": "user", "content": "Tell me about ships"}]
    history.save(b)
    listed = history.list_conversations(history.DEFAULT_USER, "Assistant")
    assert [c["id"] for c in listed] == [b.id, a.id]  # newest first
    assert listed[0]["title"] == "Tell me about ships"
    assert history.load(history.DEFAULT_USER, "Assistant", a.id).messages == a.messages
    assert [c["id"] for c in history.search(history.DEFAULT_USER, "LIGHTHOUSES")] == [a.id]
    history.rename(history.DEFAULT_USER, "Assistant", a.id, "Renamed")
    assert history.load(history.DEFAULT_USER, "Assistant", a.id).title == "Renamed"
    history.delete(history.DEFAULT_USER, "Assistant", a.id)
    assert [c["id"] for c in history.list_conversations(history.DEFAULT_USER)] == [b.id]
    with pytest.raises(InvalidRequest):
        history.load(history.DEFAULT_USER, "Assistant", "../../etc")


def test_users_do_not_see_each_other(hub: object) -> None:
    mine = make_conv()
    mine.user = "alice"
    history.save(mine)
    assert history.list_conversations("bob") == []
    assert [c["id"] for c in history.list_conversations("alice")] == [mine.id]


def test_branch_keeps_messages_up_to_the_index(hub: object) -> None:
    conv = make_conv(6)
    copy = history.branch(conv, 2)
    assert copy.id != conv.id and copy.messages == conv.messages[:3]
    with pytest.raises(InvalidRequest):
        history.branch(conv, 6)


def test_uploads_are_validated(hub: object) -> None:
    good = history.from_json([{"role": "user", "content": "hi"}], user="u", character="c")
    assert good.messages == [{"role": "user", "content": "hi"}]
    for bad in (
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": "nope"},
        42,
        {"messages": [{"role": "user"}]},
    ):
        with pytest.raises(InvalidRequest):
            history.from_json(bad, user="u", character="c")


KILL_LOOP = r"""
import sys
sys.path.insert(0, {root!r})
from modules import shared
from modules.settings import load_settings
from modules.chat import history
shared.init(load_settings(["--user-data-dir", {user_data!r}], env={{}}))
conv = history.Conversation(id="crashtest", character="Assistant")
i = 0
while True:
    i += 1
    conv.messages = [{{"role": "user", "content": "x" * 20000 + str(i)}}] * (1 + i % 50)
    history.save(conv)
    print(i, flush=True)
"""


def test_killed_while_saving_leaves_the_file_intact(tmp_path: Path) -> None:
    """Kill -9 a process that keeps saving a large history; every time, the file is the old or the new one."""
    user_data = tmp_path / "ud"
    script = tmp_path / "loop.py"
    script.write_text(KILL_LOOP.format(root=str(ROOT), user_data=str(user_data)))
    path = user_data / "logs" / "default" / "Assistant" / "crashtest.json"
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        for _ in range(3 + attempt * 2):  # let it write a few times, then kill it mid-write
            proc.stdout.readline()
        time.sleep(0.003 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        data = json.loads(path.read_text())  # never half a file
        assert data["id"] == "crashtest" and len(data["messages"]) >= 1
    leftovers = [p.name for p in path.parent.iterdir() if p.name != "crashtest.json"]
    assert all(name.startswith(".crashtest.json.") for name in leftovers)  # at most temp files, never a torn target


def card_png(payload: dict, key: str = "chara") -> bytes:
    image = Image.new("RGB", (8, 8), "purple")
    info = PngInfo()
    info.add_text(key, base64.b64encode(json.dumps(payload).encode()).decode())
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def test_v1_and_v2_png_cards_and_json(hub: object, user_data: Path) -> None:
    v1 = {"name": "Seraphina", "description": "A guardian of the forest.", "personality": "kind", "scenario": "In the glade.",
          "first_mes": "*smiles* Welcome, {{user}}.", "mes_example": "<START>\n{{user}}: Hi\n{{char}}: Hello!"}  # fmt: skip
    imported = characters.import_card(card_png(v1))
    assert imported.name == "Seraphina" and imported.greeting.startswith("*smiles*")
    assert "guardian of the forest" in imported.context and "Scenario: In the glade." in imported.context
    assert "<START>" not in imported.context and imported.picture is not None
    v2 = {
        "spec": "chara_card_v2",
        "spec_version": "2.0",
        "data": {"name": "Captain Vega", "description": "A starship captain.", "first_mes": "Report!"},
    }
    captain = characters.import_card(card_png(v2))
    assert captain.key == "Captain Vega" and captain.greeting == "Report!"
    from_json = characters.import_card(json.dumps({"name": "Plain", "description": "From JSON."}).encode())
    assert from_json.context == "From JSON."
    assert {"Seraphina", "Captain Vega", "Plain"} <= set(characters.list_characters())
    again = characters.import_card(card_png({**v1, "first_mes": "A second Seraphina."}))
    assert again.key == "Seraphina (2)" and again.name == "Seraphina"  # the first one is not overwritten
    assert characters.load_character("Seraphina").greeting.startswith("*smiles*")
    with pytest.raises(InvalidRequest, match="chara"):
        plain = io.BytesIO()
        Image.new("RGB", (4, 4)).save(plain, format="PNG")
        characters.import_card(plain.getvalue())
    with pytest.raises(InvalidRequest):
        characters.import_card(b"not a card at all")


def test_save_and_delete_character(hub: object) -> None:
    saved = characters.save_character("Tester", "Tess", "Tess tests things.", "Hello, I test.")
    assert characters.load_character("Tester").name == "Tess" and saved.greeting == "Hello, I test."
    characters.delete_character("Tester")
    assert "Tester" not in characters.list_characters()
    with pytest.raises(InvalidRequest):
        characters.save_character("../escape", "x", "y")


def test_a_failed_regenerate_gives_the_old_reply_back(hub: object) -> None:
    """Regenerate hides the old reply while the new one streams; when generation fails, the old one returns."""
    from modules.chat import engine
    from modules.errors import ModelNotLoaded
    from modules.generation.params import GenerationParams

    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "new", "versions": ["old", "new"], "version": 1},
    ]
    seen = []
    with pytest.raises(ModelNotLoaded):  # no model is loaded
        for update in engine.regenerate(chat, GenerationParams()):
            seen.append(update.history)
    assert seen[0] == chat[:1] and seen[-1] == chat


def test_different_names_never_share_a_folder(hub: object, user_data: Path) -> None:
    names = ["bob", "bob!", "bob?", "bob_", "bob.", " bob", "a/b", "..", "bob_-" + "0" * 12]
    folders = [history._folder_name(n) for n in names]
    assert len(set(folders)) == len(names)
    assert folders[0] == "bob" and folders[3] == "bob_"  # plain names stay readable
    for name in names:
        conv = history.new_conversation("Assistant", user=name)
        conv.messages.append({"role": "user", "content": f"secret of {name}"})
        history.save(conv)
    for name in names:
        [entry] = history.list_conversations(name, "Assistant")
        assert history.load(name, "Assistant", entry["id"]).messages[0]["content"] == f"secret of {name}"


def test_uploaded_histories_cannot_point_at_server_files(hub: object, user_data: Path) -> None:
    kept = str(history.images_dir() / "abc.png")
    checked = history.validate_messages(
        [{"role": "user", "content": "look", "images": ["/etc/passwd", kept, str(history.images_dir() / ".." / "x")]}]
    )
    assert checked[0]["images"] == [kept]
    from modules.images import load_image

    with pytest.raises(InvalidRequest):
        load_image("/etc/hostname")  # no folder given: a client's path is never read


def test_a_chat_is_saved_once_started_and_its_removals_too(hub: object, user_data: Path) -> None:
    conv = history.new_conversation("Assistant", greeting="Hello!")
    assert not history.save_if_started(conv, "Hello!")  # only the greeting: no file
    conv.messages.append({"role": "assistant", "content": "sent as the assistant"})
    assert history.save_if_started(conv, "Hello!")
    conv.messages = conv.messages[:1]  # "remove last" back to the greeting: the file must follow
    assert history.save_if_started(conv, "Hello!")
    assert history.load(conv.user, "Assistant", conv.id).messages == [{"role": "assistant", "content": "Hello!"}]


def test_atomic_writes_keep_a_files_mode_and_give_new_files_the_umask_mode(tmp_path: Path) -> None:
    """mkstemp makes 0600 temp files; a rename must not turn the user's 0644 (or 0664) files into 0600."""
    import os
    import stat

    from modules import fileio

    old = os.umask(0o022)
    try:
        new = tmp_path / "new.yaml"
        fileio.atomic_write_text(new, "a: 1\n")
        assert stat.S_IMODE(new.stat().st_mode) == 0o644
        shared_file = tmp_path / "shared.json"
        shared_file.write_text("{}")
        shared_file.chmod(0o664)
        fileio.atomic_write_text(shared_file, '{"b": 2}')
        assert stat.S_IMODE(shared_file.stat().st_mode) == 0o664 and shared_file.read_text() == '{"b": 2}'
    finally:
        os.umask(old)
