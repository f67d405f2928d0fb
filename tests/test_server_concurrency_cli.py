"""`--max-concurrency`, `--max-queue` and `--request-timeout`: flags -> settings -> the app's worker, the engine
options, and errors that name the flag."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from dflash.cli import build_parser
from dflash.cli import common as common_cli
from dflash.cli import serve as serve_cli
from dflash.engine.engine import EngineOptions
from dflash.errors import DFlashError
from dflash.server import ServerSettings, create_app
from tests.server_helpers import FakeEngine


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_API_KEY", raising=False)


def parse(*argv: str) -> Any:
    return build_parser().parse_args(["serve", *argv])


def test_flags_become_settings() -> None:
    settings = serve_cli.settings_from_args(parse("--max-concurrency", "4", "--max-queue", "0",
                                                  "--request-timeout", "90"))
    assert (settings.max_concurrency, settings.max_queue, settings.request_timeout_s) == (4, 0, 90.0)
    defaults = serve_cli.settings_from_args(parse())
    assert (defaults.max_concurrency, defaults.request_timeout_s) == (None, None)
    assert defaults.max_queue == ServerSettings().max_queue == serve_cli.DEFAULT_MAX_QUEUE


@pytest.mark.parametrize(("argv", "flag"), [
    (("--max-concurrency", "0"), "--max-concurrency"),
    (("--max-queue", "-1"), "--max-queue"),
    (("--request-timeout", "0"), "--request-timeout"),
    (("--request-timeout", "nan"), "--request-timeout"),
])
def test_bad_values_name_the_flag(argv: tuple[str, ...], flag: str) -> None:
    with pytest.raises(DFlashError, match=flag):
        serve_cli.settings_from_args(parse(*argv))


def test_help_describes_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    for flag in ("--max-concurrency", "--max-queue", "--request-timeout", "429", "529", "Retry-After"):
        assert flag in text


def test_the_worker_follows_the_flag_or_the_engines_batch() -> None:
    engine = FakeEngine(options=SimpleNamespace(spec="none", max_batch=6))
    app = create_app(engine, ServerSettings(max_queue=3, request_timeout_s=5.0))
    worker = app.state.ctx.worker
    assert (worker.concurrency, worker.max_queue, app.state.ctx.runner.request_timeout_s) == (6, 3, 5.0)
    assert create_app(engine, ServerSettings(max_concurrency=2)).state.ctx.worker.concurrency == 2
    assert create_app(FakeEngine(), ServerSettings()).state.ctx.worker.concurrency == 1  # no max_batch: one


def test_serve_builds_the_app_from_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    started: dict[str, Any] = {}
    monkeypatch.setattr(serve_cli, "engine_from_args", lambda args: FakeEngine())
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: started.update(app=app, **kwargs))
    assert serve_cli.run(parse("--max-concurrency", "3", "--max-queue", "5", "--request-timeout", "12")) == 0
    ctx = started["app"].state.ctx
    assert (ctx.worker.concurrency, ctx.worker.max_queue, ctx.runner.request_timeout_s) == (3, 5, 12.0)


def test_the_engine_options_get_the_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash.engine.loading as loading

    seen: list[EngineOptions] = []

    def load(*_args: Any, options: EngineOptions, **_kwargs: Any) -> str:
        seen.append(options)
        return "engine"

    monkeypatch.setattr(loading, "load_engine", load)
    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--max-concurrency", "3"])
    if "max_batch" in {f.name for f in dataclasses.fields(EngineOptions)}:
        assert common_cli.engine_from_args(generate) == "engine"
        assert getattr(seen[0], "max_batch") == 3  # noqa: B009 (a field only the batching engine has)
    else:  # an engine that cannot batch refuses the flag rather than ignoring it
        with pytest.raises(DFlashError, match="--max-concurrency"):
            common_cli.engine_from_args(generate)
    seen.clear()
    common_cli.engine_from_args(build_parser().parse_args(["generate", "--prompt", "hi"]))
    # without the flag the engine keeps its own default batch
    assert getattr(seen[0], "max_batch", None) == getattr(EngineOptions(), "max_batch", None)


def test_one_shot_commands_make_no_batched_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dflash generate` and `dflash chat` never run two requests at once: their engines decode one at a time (no
    batched K/V pool), unless --max-concurrency says otherwise; `serve` keeps the engine's default."""
    import dflash.engine.loading as loading
    from dflash.cli import chat as chat_cli
    from dflash.cli import generate as generate_cli

    seen: list[EngineOptions] = []

    def load(*_args: Any, options: EngineOptions, **_kwargs: Any) -> str:
        seen.append(options)
        return "engine"

    monkeypatch.setattr(loading, "load_engine", load)
    generate = build_parser().parse_args(["generate", "--prompt", "hi"])
    common_cli.engine_from_args(generate, one_at_a_time=True)
    common_cli.engine_from_args(build_parser().parse_args(["generate", "--prompt", "hi", "--max-concurrency", "3"]),
                                one_at_a_time=True)
    assert [options.max_batch for options in seen] == [1, 3]
    asked: list[dict[str, Any]] = []

    class Stop(Exception):
        pass

    def engine_from_args(args: Any, *rest: Any, **kwargs: Any) -> None:
        asked.append(kwargs)
        raise Stop

    for module, argv in ((generate_cli, ["generate", "--prompt", "hi"]), (chat_cli, ["chat"])):
        monkeypatch.setattr(module, "engine_from_args", engine_from_args)
        with pytest.raises(Stop):
            module.run(build_parser().parse_args(argv))
    assert asked == [{"one_at_a_time": True}, {"one_at_a_time": True}]
