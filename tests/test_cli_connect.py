"""`dflash connect`: the printed settings parse and carry the server's values, the model and context are read
from a running server, `--write` merges into existing client configs without losing anything, conflicts are
refused unless forced, and an API key's value is never printed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import tomlkit

from dflash.cli import main
from dflash.server import ServerSettings, create_app
from tests.server_helpers import FakeEngine, serving

EXPLICIT = ["--url", "http://gpu-box:9000/v1/", "--model", "qwen-coder", "--context-length", "32768"]
SECRET = "sk-do-not-print-me"


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh HOME and config folders, and an API key in the environment that must never be printed."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CODEX_HOME", str(home / ".codex"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("DFLASH_API_KEY", SECRET)
    return home


def connect(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["connect", *argv])
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    return code, out, err


def test_codex_printed_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = connect(capsys, "codex", *EXPLICIT)
    assert code == 0
    settings = tomlkit.parse(out).unwrap()
    assert settings == {
        "model": "qwen-coder", "model_provider": "dflash", "model_context_window": 32768,
        "model_providers": {"dflash": {"name": "dflash-server", "base_url": "http://gpu-box:9000/v1",
                                       "wire_api": "responses", "env_key": "DFLASH_API_KEY"}},
    }


def test_opencode_printed_settings(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = connect(capsys, "opencode", *EXPLICIT, "--api-key-env", "MY_KEY")
    assert code == 0
    settings = json.loads(out)
    provider = settings["provider"]["dflash"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://gpu-box:9000/v1", "apiKey": "{env:MY_KEY}"}
    assert provider["models"]["qwen-coder"]["limit"] == {"context": 32768, "output": 8192}
    assert settings["model"] == "dflash/qwen-coder"


def test_claude_exports_source_in_a_shell(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = connect(capsys, "claude", *EXPLICIT)
    assert code == 0
    assert "$DFLASH_API_KEY" in out  # the key is read when the shell runs the lines
    script = out + "\nenv -0"
    with_key = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin", "DFLASH_API_KEY": "k1"},
                              capture_output=True, check=True).stdout.decode()
    env = dict(item.split("=", 1) for item in with_key.split("\0") if "=" in item)
    assert env["ANTHROPIC_BASE_URL"] == "http://gpu-box:9000"  # the Anthropic client adds /v1 itself
    assert env["ANTHROPIC_AUTH_TOKEN"] == "k1"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == "qwen-coder"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    without_key = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                                 check=True).stdout.decode()
    assert "ANTHROPIC_AUTH_TOKEN=none\0" in without_key  # a server without --api-key takes any token


def test_model_and_context_come_from_the_running_server(capsys: pytest.CaptureFixture[str]) -> None:
    engine = FakeEngine(model_name="served-model", max_ctx=6000)
    with serving(create_app(engine, ServerSettings(api_key=SECRET))) as server:
        code, out, _ = connect(capsys, "codex", "--url", server.url)
        assert code == 0
        settings = tomlkit.parse(out).unwrap()
        assert settings["model"] == "served-model" and settings["model_context_window"] == 6000
        assert settings["model_providers"]["dflash"]["base_url"] == f"{server.url}/v1"
        code, _, err = connect(capsys, "claude", "--url", server.url, "--api-key-env", "UNSET_KEY_VARIABLE")
    assert code == 2
    assert "HTTP 401" in err and "set UNSET_KEY_VARIABLE" in err


def test_host_and_port_name_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = connect(capsys, "codex", "--host", "0.0.0.0", "--port", "8123", "--model", "m", "--context-length", "100")
    assert code == 0
    assert tomlkit.parse(out).unwrap()["model_providers"]["dflash"]["base_url"] == "http://127.0.0.1:8123/v1"


def test_unreachable_server_and_bad_arguments_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = connect(capsys, "codex", "--url", "http://127.0.0.1:9")
    assert code == 2 and out == ""
    assert "could not read the model from http://127.0.0.1:9/v1/models" in err and "--model and --context-length" in err
    assert connect(capsys, "codex", "--url", "gpu-box:9000", "--model", "m", "--context-length", "100")[0] == 2
    assert connect(capsys, "codex", *EXPLICIT, "--api-key-env", "NOT A NAME")[0] == 2
    code, _, err = connect(capsys, "claude", *EXPLICIT, "--write")
    assert code == 2 and "environment" in err


EXISTING_CODEX = """\
# personal settings
approval_policy = "on-request"  # asked every time

[model_providers.other]
name = "Other"
base_url = "http://other:1/v1"

[profiles.fast]
model = "tiny"
"""


def test_codex_write_keeps_existing_settings(capsys: pytest.CaptureFixture[str], isolated: Path) -> None:
    path = isolated / ".codex" / "config.toml"
    path.parent.mkdir()
    path.write_text(EXISTING_CODEX, encoding="utf-8")
    code, out, _ = connect(capsys, "codex", *EXPLICIT, "--write")
    assert code == 0 and str(path) in out
    text = path.read_text(encoding="utf-8")
    assert "# personal settings" in text and "# asked every time" in text  # comments survive
    settings = tomlkit.parse(text).unwrap()
    assert settings["approval_policy"] == "on-request"
    assert settings["profiles"] == {"fast": {"model": "tiny"}}
    assert settings["model_providers"]["other"]["base_url"] == "http://other:1/v1"
    assert settings["model_providers"]["dflash"]["base_url"] == "http://gpu-box:9000/v1"
    assert settings["model"] == "qwen-coder" and settings["model_provider"] == "dflash"
    assert connect(capsys, "codex", *EXPLICIT, "--write")[0] == 0  # the same settings again: nothing to refuse
    assert path.read_text(encoding="utf-8") == text


def test_codex_write_refuses_a_different_provider_unless_forced(capsys: pytest.CaptureFixture[str],
                                                                isolated: Path) -> None:
    path = isolated / ".codex" / "config.toml"
    assert connect(capsys, "codex", *EXPLICIT, "--write")[0] == 0
    with path.open("a", encoding="utf-8") as handle:
        handle.write('query_params = { tag = "mine" }\n')  # a key of the user's own inside the table
    before = path.read_text(encoding="utf-8")
    moved = ["--url", "http://gpu-box:9001", "--model", "qwen-coder", "--context-length", "32768"]
    code, _, err = connect(capsys, "codex", *moved, "--write")
    assert code == 2 and "model_providers.dflash.base_url" in err and "--force" in err
    assert path.read_text(encoding="utf-8") == before  # nothing written
    code, out, _ = connect(capsys, "codex", *moved, "--write", "--force")
    assert code == 0 and "overwrote model_providers.dflash.base_url" in out
    provider = tomlkit.parse(path.read_text(encoding="utf-8")).unwrap()["model_providers"]["dflash"]
    assert provider["base_url"] == "http://gpu-box:9001/v1" and provider["query_params"] == {"tag": "mine"}


def test_opencode_write_keeps_existing_settings(capsys: pytest.CaptureFixture[str], isolated: Path) -> None:
    path = isolated / ".config" / "opencode" / "opencode.json"
    path.parent.mkdir(parents=True)
    existing = {"theme": "dark", "provider": {"ollama": {"npm": "@ai-sdk/openai-compatible", "models": {"a": {}}}}}
    path.write_text(json.dumps(existing), encoding="utf-8")
    assert connect(capsys, "opencode", *EXPLICIT, "--write")[0] == 0
    settings = json.loads(path.read_text(encoding="utf-8"))
    assert settings["theme"] == "dark" and settings["provider"]["ollama"] == existing["provider"]["ollama"]
    assert settings["provider"]["dflash"]["options"]["baseURL"] == "http://gpu-box:9000/v1"
    assert settings["model"] == "dflash/qwen-coder"
    code, _, err = connect(capsys, "opencode", *EXPLICIT[:3], "other-model", *EXPLICIT[4:], "--write")
    assert code == 2 and "already sets model to other values" in err  # the default model would change


def test_opencode_write_refuses_a_file_with_comments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "opencode.jsonc"
    path.write_text('{\n  // mine\n  "theme": "dark"\n}\n', encoding="utf-8")
    code, _, err = connect(capsys, "opencode", *EXPLICIT, "--write", "--config", str(path))
    assert code == 2 and "not plain JSON" in err
    assert path.read_text(encoding="utf-8") == '{\n  // mine\n  "theme": "dark"\n}\n'
