"""Settings: one schema for flags, settings.yaml and env, with the documented precedence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from modules.settings import Settings, SettingsError, build_parser, load_settings

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_without_any_source(tmp_path: Path) -> None:
    loaded = load_settings(["--user-data-dir", str(tmp_path)], env={})
    assert loaded.settings.listen_port == 7860
    assert loaded.settings.host == "127.0.0.1"
    assert loaded.settings.parallel == 4
    assert loaded.explicit == {"user_data_dir"}


def test_precedence_yaml_then_env_then_cli(tmp_path: Path) -> None:
    write(tmp_path / "settings.yaml", "listen_port: 7001\nthreads: 3\nn_ctx: 1024\nparallel: 2\n")
    args = ["--user-data-dir", str(tmp_path)]
    env = {"TEXTGEN_THREADS": "5", "TEXTGEN_N_CTX": "2048"}
    loaded = load_settings([*args, "--n-ctx", "512"], env=env)
    s = loaded.settings
    assert s.parallel == 2  # yaml over default
    assert s.listen_port == 7001  # yaml
    assert s.threads == 5  # env over yaml
    assert s.n_ctx == 512  # cli over env
    assert {"threads", "n_ctx"} <= loaded.explicit and "parallel" not in loaded.explicit


def test_settings_flag_reads_another_file(tmp_path: Path) -> None:
    other = write(tmp_path / "other.yaml", "listen-port: 7100\nverbose: true\n")
    s = load_settings(["--settings", str(other), "--user-data-dir", str(tmp_path / "none")], env={}).settings
    assert s.listen_port == 7100 and s.verbose is True


def test_extension_params_and_ui_defaults_are_split_out(tmp_path: Path) -> None:
    write(tmp_path / "settings.yaml", "character_bias-bias_string: '*happy*'\npreset: Min-P\n")
    loaded = load_settings(["--user-data-dir", str(tmp_path)], env={})
    assert loaded.extension_params == {"character_bias": {"bias_string": "*happy*"}}
    assert loaded.extra == {"preset": "Min-P"}


def test_lists_and_bools_from_every_source(tmp_path: Path) -> None:
    env = {"TEXTGEN_EXTENSIONS": "openai,example", "TEXTGEN_LISTEN": "true"}
    s = load_settings(["--user-data-dir", str(tmp_path)], env=env).settings
    assert s.extensions == ["openai", "example"] and s.listen and s.host == "0.0.0.0"
    s = load_settings(["--user-data-dir", str(tmp_path), "--extensions", "a", "b", "--no-listen"], env=env).settings
    assert s.extensions == ["a", "b"] and not s.listen


@pytest.mark.parametrize(
    ("argv", "env", "yaml_text", "needle"),
    [
        (["--listen-port", "0"], {}, None, "--listen-port"),
        ([], {"TEXTGEN_PARALLEL": "lots"}, None, "--parallel"),
        ([], {}, "listen_port: [1, 2]\n", "--listen-port"),
        ([], {}, "- just\n- a list\n", "mapping"),
        ([], {}, "key: [unclosed\n", "YAML"),
    ],
)
def test_bad_values_are_clear_errors(
    tmp_path: Path, argv: list[str], env: dict[str, str], yaml_text: str | None, needle: str
) -> None:
    if yaml_text is not None:
        write(tmp_path / "settings.yaml", yaml_text)
    with pytest.raises(SettingsError, match=needle):
        load_settings(["--user-data-dir", str(tmp_path), *argv], env=env)


def test_help_documents_every_flag() -> None:
    text = build_parser().format_help()
    for name, info in Settings.model_fields.items():
        assert "--" + name.replace("_", "-") in text
        assert info.description, f"{name} has no description"
    result = subprocess.run(
        [sys.executable, "server.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    for flag in (
        "--model",
        "--loader",
        "--listen-port",
        "--n-gpu-layers",
        "--gradio-auth",
        "--multi-user",
        "--api-key",
    ):
        assert flag in result.stdout


def test_server_refuses_bad_flag_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "server.py", "--user-data-dir", str(tmp_path), "--parallel", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--parallel" in result.stderr and "Traceback" not in result.stderr


def test_gradio_auth_pairs(tmp_path: Path) -> None:
    auth_file = write(tmp_path / "auth.txt", "carol:pw3\n")
    s = Settings(gradio_auth="alice:pw1, bob:pw2", gradio_auth_path=auth_file)
    assert s.auth_pairs() == [("alice", "pw1"), ("bob", "pw2"), ("carol", "pw3")]
    with pytest.raises(SettingsError):
        Settings(gradio_auth="nocolon").auth_pairs()
