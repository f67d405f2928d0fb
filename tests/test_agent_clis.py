"""The real Claude Code and Codex command lines against a loopback server, set up with `dflash connect`.

The answers come from the real default model (SmolLM2-135M-Instruct with its DFlash drafter, on the CPU).
That model is too small to call a tool when asked, so the tool round trip runs against a scripted engine that
writes a call in the model's format; Claude Code then really runs its Read tool and sends the result back. A
full (not --bare) Claude Code session, with its `system` message inside `messages`, also runs against a
scripted engine: its prompt is larger than the default model's context.

Overflow: Claude Code asks for 32k output tokens unless told otherwise; the server's Anthropic-worded
"input length and `max_tokens` exceed context limit: A + B > C" makes it retry with a budget that fits, and a
prompt larger than the whole context ends the run with its "Prompt is too long" message carrying the server's
figures (no hang, no crash).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomlkit

from dflash.engine.loading import load_engine
from dflash.generation.request import GenerationRequest
from dflash.server import ServerSettings, create_app
from tests.agent_clients import (
    KEY_ENV,
    QUIET_CLAUDE,
    QUIET_CODEX_TOML,
    Sandbox,
    client_binary,
    dflash_connect,
    run_client,
    sourced,
)
from tests.server_helpers import FakeEngine, ServerThread, metric, serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SAY_HI = "Say hi"


@pytest.fixture(scope="module")
def claude() -> Path:
    return client_binary("claude")


@pytest.fixture(scope="module")
def codex() -> Path:
    return client_binary("codex")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """`dflash serve` with its defaults: the default model and its drafter (DDTree decoding)."""
    with serving(create_app(load_engine("default"), ServerSettings())) as running:
        yield running


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    return Sandbox(tmp_path)


def claude_env(server: ServerThread, sandbox: Sandbox, *, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment `eval "$(dflash connect claude)"` gives, less the variables named in `drop`."""
    env = sourced(dflash_connect("claude", "--url", server.url), {**sandbox.base_env(), **QUIET_CLAUDE})
    assert env["ANTHROPIC_AUTH_TOKEN"] == "test-key"  # read from $DFLASH_API_KEY when the shell ran it
    return {name: value for name, value in env.items() if name not in drop}


def messages_status(server: ServerThread, status: int) -> float:
    return metric(server.url, "dflash_http_requests_total", route="/v1/messages", method="POST", status=str(status))


def test_claude_code_answers(claude: Path, server: ServerThread, sandbox: Sandbox) -> None:
    ok_before = messages_status(server, 200)
    run = run_client([str(claude), "-p", "--bare", SAY_HI], claude_env(server, sandbox), sandbox.work, timeout=120)
    assert run.code == 0, run.output
    assert run.stdout.strip()
    assert messages_status(server, 200) == ok_before + 1  # the answer came from this server


def test_claude_code_default_output_budget_is_retried_to_fit(claude: Path, server: ServerThread,
                                                             sandbox: Sandbox) -> None:
    # Without CLAUDE_CODE_MAX_OUTPUT_TOKENS Claude Code asks for 32000 output tokens, more than the whole
    # 8192-token context: it reads the figures of the server's 400 and asks again with what fits.
    env = claude_env(server, sandbox, drop=("CLAUDE_CODE_MAX_OUTPUT_TOKENS", "CLAUDE_CODE_MAX_CONTEXT_TOKENS"))
    refused_before, ok_before = messages_status(server, 400), messages_status(server, 200)
    run = run_client([str(claude), "-p", "--bare", SAY_HI], env, sandbox.work, timeout=120)
    assert run.code == 0, run.output
    assert run.stdout.strip()
    assert messages_status(server, 400) == refused_before + 1
    assert messages_status(server, 200) == ok_before + 1


def test_claude_code_shows_the_servers_prompt_too_long(claude: Path, server: ServerThread, sandbox: Sandbox) -> None:
    # The context length is left out so that Claude Code sends the prompt instead of refusing it itself.
    env = claude_env(server, sandbox, drop=("CLAUDE_CODE_MAX_CONTEXT_TOKENS",))
    refused_before = messages_status(server, 400)
    started = time.monotonic()
    run = run_client([str(claude), "-p", "--bare", "--tools", "", "--", "Count the apples. " * 3000], env,
                     sandbox.work, timeout=60)
    assert run.code != 0
    assert "prompt is too long" in run.output.lower(), run.output
    assert re.search(r"limit 8191\b", run.output), run.output  # the server's figure: 8192 less one output token
    assert messages_status(server, 400) == refused_before + 1
    assert time.monotonic() - started < 30


def test_claude_code_tool_round_trip(claude: Path, sandbox: Sandbox) -> None:
    note = sandbox.work / "note.txt"
    note.write_text("the secret word is pelican\n", encoding="utf-8")
    call = "<tool_call>\n" + json.dumps({"name": "Read", "arguments": {"file_path": str(note)}}) + "\n</tool_call>"

    def agent(prompt: str, request: GenerationRequest) -> str:
        # Call the tool until its result is in the conversation, then answer from it.
        found = re.search(r"the secret word is (\w+)", prompt)
        return f"The note says the secret word is {found.group(1)}." if found else call

    engine = FakeEngine(max_ctx=32768, model_name="scripted-agent").script(agent, agent)
    with serving(create_app(engine, ServerSettings())) as server:
        env = claude_env(server, sandbox)
        run = run_client([str(claude), "-p", "--bare", "--tools", "Read", "--allowedTools", "Read", "--",
                          "What is the secret word in note.txt?"], env, sandbox.work, timeout=120)
    assert run.code == 0, run.output
    assert "pelican" in run.stdout  # only the file holds it: Claude Code ran Read and sent back its result
    assert len(engine.prompts) == 2
    assert "Read" in engine.prompts[0] and "pelican" not in engine.prompts[0]
    assert "the secret word is pelican" in engine.prompts[1]


def test_codex_exec_answers_through_the_connect_provider(codex: Path, server: ServerThread, sandbox: Sandbox) -> None:
    config = sandbox.codex_home / "config.toml"
    config.write_text(QUIET_CODEX_TOML, encoding="utf-8")
    dflash_connect("codex", "--url", server.url, "--write", "--config", str(config))
    settings = tomlkit.parse(config.read_text(encoding="utf-8")).unwrap()
    assert settings["features"] == {"plugins": False} and settings["analytics"] == {"enabled": False}  # kept
    provider = settings["model_providers"]["dflash"]
    assert provider["base_url"] == f"{server.url}/v1" and provider["env_key"] == KEY_ENV

    ok_before = metric(server.url, "dflash_http_requests_total", route="/v1/responses", method="POST", status="200")
    run = run_client([str(codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only", SAY_HI],
                     sandbox.base_env(), sandbox.work, timeout=180)
    assert run.code == 0, run.output
    assert run.stdout.strip()
    assert "provider: dflash" in run.stderr and f"model: {settings['model']}" in run.stderr
    assert metric(server.url, "dflash_http_requests_total", route="/v1/responses", method="POST",
                  status="200") == ok_before + 1


def test_claude_code_full_session_sends_mid_conversation_system(claude: Path, sandbox: Sandbox) -> None:
    # Without --bare, Claude Code puts its environment notes in a `system` message after the user's; its
    # prompt (about 12K tokens) outgrows the default model, so a scripted engine with a larger context answers.
    engine = FakeEngine(max_ctx=65536, model_name="scripted-agent", default="Hi from the scripted engine.")
    with serving(create_app(engine, ServerSettings())) as server:
        run = run_client([str(claude), "-p", "--", SAY_HI], claude_env(server, sandbox), sandbox.work, timeout=120)
    assert run.code == 0, run.output
    assert "Hi from the scripted engine." in run.stdout
    assert any("Primary working directory" in prompt for prompt in engine.prompts)
