"""`dflash serve` command line: flags -> settings, start-up banner, and errors that name the flag."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dflash.cli import build_parser
from dflash.cli import serve as serve_cli
from dflash.errors import DFlashError
from tests.server_helpers import FakeEngine


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)  # the defaults below assume a keyless server


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


def test_flags_become_settings(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    args = parse("--host", "0.0.0.0", "--port", "9001", "--served-model-name", "coder", "--api-key", "k",
                 "--chat-template-file", str(template), "--default-max-tokens", "64", "--remap-developer-role",
                 "--spec", "none", "--draft", "none")
    settings = serve_cli.settings_from_args(args)
    assert (settings.host, settings.port, settings.served_model_name, settings.api_key) == ("0.0.0.0", 9001, "coder", "k")
    assert settings.chat_template == "{{ messages[0]['content'] }}"
    assert settings.default_max_tokens == 64 and settings.remap_developer_role
    assert settings.max_body_bytes == 8 * 1024 * 1024
    defaults = serve_cli.settings_from_args(parse())
    assert (defaults.host, defaults.port, defaults.api_key, defaults.chat_template) == ("127.0.0.1", 8000, None, None)


def test_bad_flags_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DFlashError, match="--chat-template-file"):
        serve_cli.settings_from_args(parse("--chat-template-file", str(tmp_path / "missing.jinja")))
    with pytest.raises(DFlashError, match="--default-max-tokens"):
        serve_cli.settings_from_args(parse("--default-max-tokens", "0"))
    with pytest.raises(DFlashError, match="--port"):
        serve_cli.settings_from_args(parse("--port", "70000"))


def test_run_prints_how_to_connect(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import uvicorn

    started: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "engine_from_args", lambda args: FakeEngine())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: started.update(app=app, **kwargs))
    monkeypatch.setenv("DFLASH_DEGENERATE_RUN_TOKENS", "64")
    assert serve_cli.run(parse("--port", "8123", "--api-key", "k")) == 0
    assert (started["host"], started["port"]) == ("127.0.0.1", 8123)
    assert started["app"].state.ctx.settings.stall.degenerate_run_tokens == 64
    err = capsys.readouterr().err
    assert "listening on http://127.0.0.1:8123" in err
    assert 'base_url="http://127.0.0.1:8123/v1"' in err and "ANTHROPIC_BASE_URL=http://127.0.0.1:8123" in err
    assert "DFLASH_DEGENERATE_RUN_TOKENS=64" in err
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert issubclass(started["http"], H11Protocol)  # the protocol with the header deadline


def test_bad_stall_environment_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_MIN_TOKENS", "several")
    with pytest.raises(DFlashError, match="DFLASH_MIN_TOKENS"):
        serve_cli.settings_from_args(parse())
