"""`dflash serve` API key and browser flags: the key comes from `--api-key`, `--api-key-file` or
`$DFLASH_API_KEY`, is never printed, and the banner's client hints name it in a form that works; bad key
sources and bad flag values stop start-up with an error naming them."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dflash.cli import build_parser
from dflash.cli import serve as serve_cli
from dflash.cli.api_key import APIKey, load_api_key
from dflash.engine.engine import EngineOptions
from dflash.errors import DFlashError
from dflash.server import create_app
from tests.server_helpers import FakeEngine, serving

pytestmark = pytest.mark.timeout(60)

SECRET = "sk-local-7f3a9c"


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


def key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "key"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ sources
def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_API_KEY", SECRET)
    assert serve_cli.settings_from_args(parse()).api_key == SECRET
    assert serve_cli.settings_from_args(parse("--api-key", "other")).api_key == "other"  # the flag wins
    monkeypatch.setenv("DFLASH_API_KEY", "  ")
    assert serve_cli.settings_from_args(parse()).api_key is None  # blank: no key


def test_key_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_API_KEY", "from-env")
    path = key_file(tmp_path, f"{SECRET}\n")
    assert serve_cli.settings_from_args(parse("--api-key-file", str(path))).api_key == SECRET


@pytest.mark.parametrize(("content", "problem"), [
    (None, "No such file"), ("", "is empty"), ("\n  \n", "is empty"), ("a\nb\n", "holds 2 lines"),
    ("clé", "printable ASCII"), (b"\xff\xfe", "not UTF-8"), ("dir", "Is a directory"),
])
def test_bad_key_files_stop_start_up(tmp_path: Path, content: str | bytes | None, problem: str) -> None:
    path = tmp_path / "key"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(DFlashError, match=f"--api-key-file {re.escape(str(path))}.*{problem}"):
        serve_cli.settings_from_args(parse("--api-key-file", str(path)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_key_file_stops_start_up(tmp_path: Path) -> None:
    path = key_file(tmp_path, SECRET)
    path.chmod(0)
    with pytest.raises(DFlashError, match="Permission denied"):
        serve_cli.settings_from_args(parse("--api-key-file", str(path)))


def test_a_read_error_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = key_file(tmp_path, SECRET)

    def refuse(self: Path, encoding: str | None = None) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(DFlashError, match=f"--api-key-file {re.escape(str(path))}: Permission denied"):
        serve_cli.settings_from_args(parse("--api-key-file", str(path)))


def test_key_given_twice_or_empty_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DFlashError, match="not both"):
        serve_cli.settings_from_args(parse("--api-key", "a", "--api-key-file", str(key_file(tmp_path, "b"))))
    with pytest.raises(DFlashError, match="--api-key: the API key is empty"):
        serve_cli.settings_from_args(parse("--api-key", ""))


# ------------------------------------------------------------------------------------------ banner
def test_run_never_prints_the_key(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                  tmp_path: Path) -> None:
    import uvicorn

    started: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "engine_from_args", lambda args: FakeEngine())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: started.update(app=app, **kwargs))
    path = key_file(tmp_path, SECRET)
    for argv, env, source in ((["--api-key", SECRET], None, "--api-key"), (["--api-key-file", str(path)], None, str(path)),
                              ([], SECRET, "$DFLASH_API_KEY")):
        if env is None:
            monkeypatch.delenv("DFLASH_API_KEY", raising=False)
        else:
            monkeypatch.setenv("DFLASH_API_KEY", env)
        assert serve_cli.run(parse("--host", "0.0.0.0", *argv)) == 0
        err = capsys.readouterr().err
        assert SECRET not in err and "dummy" not in err
        assert f"API key required on /v1/, from {source}" in err
        assert started["app"].state.ctx.settings.api_key == SECRET
        assert "warning: listening on every interface" not in err


def test_python_hints_yield_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_API_KEY", SECRET)
    from_env = load_api_key(None, None, os.environ)
    from_file = load_api_key(None, str(key_file(tmp_path, SECRET + "\n")), {})
    for key in (from_env, from_file):
        assert key is not None and eval(key.python, {"os": os}) == SECRET


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_banner_curl_line_works(tmp_path: Path, source: str) -> None:
    path = key_file(tmp_path, SECRET)
    key = load_api_key(None, str(path), {}) if source == "file" else load_api_key(None, None, {"DFLASH_API_KEY": SECRET})
    assert isinstance(key, APIKey)
    fake = FakeEngine()
    with serving(create_app(fake, serve_cli.settings_from_args(parse(), key))) as running:
        settings = serve_cli.settings_from_args(parse("--port", str(running.port)), key)
        text = serve_cli.banner(settings, "fake-model", "none", key)
        assert SECRET not in text
        curl = next(line for line in text.splitlines() if "curl:" in line).split("curl:", 1)[1].strip()
        env = {"PATH": os.environ["PATH"], "DFLASH_API_KEY": SECRET}
        answer = subprocess.run(["bash", "-c", curl + " --silent --fail-with-body"], env=env, capture_output=True,
                                text=True, timeout=30)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    assert "Hello from the fake engine." in answer.stdout and len(fake.requests) == 1


def test_banner_without_a_key_keeps_placeholder_keys() -> None:
    text = serve_cli.banner(serve_cli.settings_from_args(parse("--port", "8123")), "m", "ddtree")
    assert 'api_key="dummy"' in text and "Authorization" not in text and "API key required" not in text


def test_the_banner_says_how_many_requests_decode_at_once() -> None:
    settings = serve_cli.settings_from_args(parse("--port", "8123", "--max-queue", "5"))
    assert "decoding at once" not in serve_cli.banner(settings, "m", "ddtree")
    text = serve_cli.banner(settings, "m", "ddtree", concurrency=settings.concurrency_for(EngineOptions(max_batch=8)))
    assert "8 requests decoding at once (--max-concurrency), up to 5 waiting (--max-queue)" in text


# ------------------------------------------------------------------------------------------ other flags
def test_browser_and_timeout_flags_become_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    settings = serve_cli.settings_from_args(parse(
        "--allowed-hosts", "gpu-box.lan, 10.0.0.5", "--allowed-origins", "http://localhost:3000/,https://ui.example",
        "--body-timeout", "5", "--keep-alive-timeout", "12.5"))
    assert settings.allowed_hosts == ("gpu-box.lan", "10.0.0.5")
    assert settings.allowed_origins == ("http://localhost:3000", "https://ui.example")
    assert (settings.body_timeout_s, settings.http_keep_alive_s) == (5.0, 12.5)
    defaults = serve_cli.settings_from_args(parse())
    assert (defaults.allowed_hosts, defaults.allowed_origins, defaults.body_timeout_s) == (None, (), 60.0)
    started: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "engine_from_args", lambda args: FakeEngine())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: started.update(app=app, **kwargs))
    serve_cli.run(parse("--keep-alive-timeout", "7"))
    assert started["timeout_keep_alive"] == 7.0


@pytest.mark.parametrize(("argv", "flag"), [
    (["--allowed-origins", "localhost:3000"], "--allowed-origins"),
    (["--allowed-origins", "http://x.example/app"], "--allowed-origins"),
    (["--allowed-hosts", ","], "--allowed-hosts"),
    (["--allowed-hosts", "http://x.example"], "--allowed-hosts"),
    (["--body-timeout", "0"], "--body-timeout"),
    (["--keep-alive-timeout", "-1"], "--keep-alive-timeout"),
])
def test_bad_browser_and_timeout_flags_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(DFlashError, match=flag):
        serve_cli.settings_from_args(parse(*argv))
