"""The real default model (SmolLM2-135M, plain decoding) served to clients that arrive together: the server
hands them to the engine at once, the engine decodes them in shared steps (seen in `dflash_batch_size`), and
each client gets the answer it gets alone."""

from __future__ import annotations

import threading

import openai
import pytest

from dflash.engine.engine import EngineOptions
from dflash.engine.loading import load_engine
from dflash.server import ServerSettings, create_app
from tests.server_helpers import metric, sdk_clients, serving

pytestmark = pytest.mark.timeout(120)

QUESTIONS = ["Say hi", "Name a colour", "Count to three", "What is 2+2?"]


def ask(client: openai.OpenAI, question: str) -> str:
    answer = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
    )
    return answer.choices[0].message.content or ""


def test_clients_arriving_together_share_engine_steps_and_get_their_own_answers() -> None:
    engine = load_engine("default", "none", options=EngineOptions(spec="none", max_batch=len(QUESTIONS)))
    with serving(create_app(engine, ServerSettings())) as running:
        oa, _ = sdk_clients(running)
        alone = [ask(oa, q) for q in QUESTIONS]  # one after another: every step holds one request
        steps_alone = metric(running.url, "dflash_batch_size_count")
        shared_alone = steps_alone - metric(running.url, "dflash_batch_size_bucket", le="1.0")
        start = threading.Barrier(len(QUESTIONS))
        together: dict[int, str] = {}

        def client(i: int) -> None:
            start.wait(10)
            together[i] = ask(oa, QUESTIONS[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(QUESTIONS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        steps = metric(running.url, "dflash_batch_size_count")
        shared = steps - metric(running.url, "dflash_batch_size_bucket", le="1.0")
        queued = metric(running.url, "dflash_queue_wait_seconds_count")
    assert shared_alone == 0 and steps_alone > 0  # the engine reports its steps to the server's histogram
    assert shared > 0  # some steps decoded several clients at once
    assert [together[i] for i in range(len(QUESTIONS))] == alone
    assert queued == 2 * len(QUESTIONS)
