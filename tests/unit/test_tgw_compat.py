"""text-generation-webui's command line on ours: renamed flags, ignored ones with a note, CMD_FLAGS.txt, the API."""

from __future__ import annotations

from pathlib import Path

from modules.settings import load_settings
from modules.tgw_compat import translate


def test_a_text_generation_webui_launch_line_is_understood(tmp_path: Path) -> None:
    argv = ["--user-data-dir", str(tmp_path), "--api", "--listen", "--api-port", "5000", "--n_ctx", "2048"]
    loaded = load_settings(argv, env={})
    s = loaded.settings
    assert s.api and s.listen and s.api_port == 5000 and s.n_ctx == 2048
    assert any(note.startswith("--api: ignored, the API is on by default") for note in loaded.notes)


def test_renamed_flags_values_and_memory_units() -> None:
    args, notes = translate(["--ctx-size", "4096", "--gpu-layers=20", "--gpu-memory", "10", "8GiB", "--bf16"])
    assert args == ["--n-ctx", "4096", "--n-gpu-layers=20", "--gpu-memory", "10GiB", "8GiB", "--dtype=bfloat16"]
    assert "--ctx-size is --n-ctx here" in notes and "--bf16 is --dtype bfloat16 here" in notes


def test_flags_that_mean_nothing_here_are_dropped_with_their_values() -> None:
    args, notes = translate(["--lora", "a", "b", "--share", "--model", "m.gguf", "--character=Bob"])
    assert args == ["--model", "m.gguf"]
    assert [n.split(":")[0] for n in notes] == ["--lora", "--share", "--character"]


def test_underscore_spellings_of_every_flag(tmp_path: Path) -> None:
    s = load_settings(["--user-data-dir", str(tmp_path), "--load_in_4bit", "--threads_batch", "3"], env={}).settings
    assert s.load_in_4bit and s.threads_batch == 3


def test_cmd_flags_txt_is_read_and_the_command_line_wins(tmp_path: Path) -> None:
    (tmp_path / "CMD_FLAGS.txt").write_text("# my flags\n--listen --n_ctx 1024  # small\n--threads 3\n")
    loaded = load_settings(["--user-data-dir", str(tmp_path), "--n-ctx", "2048"], env={})
    assert loaded.settings.listen and loaded.settings.threads == 3 and loaded.settings.n_ctx == 2048
    assert "n_ctx" in loaded.explicit and loaded.notes[0].startswith("read --listen --n_ctx 1024 --threads 3 from")


def test_secrets_in_cmd_flags_txt_never_reach_the_log(tmp_path: Path) -> None:
    (tmp_path / "CMD_FLAGS.txt").write_text(
        "--api-key sk-secret-1 --admin_key=sk-secret-2\n--gradio-auth me:pw-secret-3 --remote-api-key sk-secret-4 "
        "--threads 3\n"
    )
    loaded = load_settings(["--user-data-dir", str(tmp_path)], env={})
    assert loaded.settings.api_key == "sk-secret-1" and loaded.settings.admin_key == "sk-secret-2"
    note = "\n".join(loaded.notes)
    assert "-secret-" not in note and "--api-key *** --admin_key=*** --gradio-auth *** --remote-api-key ***" in note
    assert "--threads 3" in note


def test_the_api_stays_on_whatever_the_extensions_unless_no_api(tmp_path: Path) -> None:
    base = ["--user-data-dir", str(tmp_path)]
    assert load_settings(base, env={}).settings.startup_extensions() == ["openai"]
    s = load_settings([*base, "--extensions", "example"], env={}).settings
    assert s.startup_extensions() == ["openai", "example"]
    s = load_settings([*base, "--extensions", "openai", "example", "--no-api"], env={}).settings
    assert s.startup_extensions() == ["example"]


def test_a_broken_cmd_flags_line_is_a_clear_error(tmp_path: Path) -> None:
    import pytest

    from modules.settings import SettingsError

    (tmp_path / "CMD_FLAGS.txt").write_text("--listen\n--model 'unclosed\n")
    with pytest.raises(SettingsError, match=r"CMD_FLAGS\.txt, line 2: No closing quotation"):
        load_settings(["--user-data-dir", str(tmp_path)], env={})
