"""`dflash generate` and `dflash serve` with --tensor-parallel 2 on the CPU (two gloo ranks, spawned by the command)
against a tiny Hugging Face folder: the same tokens as one process, and a server that answers the OpenAI SDK and
shuts its ranks down on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash.parallel.launch import free_port
from tests.loading_helpers import train_byte_level_tokenizer
from tests.tiny_models import hf_tiny

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 (4 heads, 2 key/value heads) with a byte-level tokenizer, saved as transformers does."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    hf_tiny("qwen3").save_pretrained(path, safe_serialization=True)
    train_byte_level_tokenizer(400).save(str(path / "tokenizer.json"))
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_API_KEY"}
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + str(REPO)
    return env


def _generate(model_dir: Path, *extra: str) -> dict[str, object]:
    command = [
        sys.executable, "-m", "dflash", "generate", "--model", str(model_dir), "--draft", "none", "--device", "cpu",
        "--prompt-ids", "5,17,200,31,9,64,120", "--max-tokens", "12", "--json",
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_generate_on_two_ranks_gives_the_tokens_of_one_process(model_dir: Path) -> None:
    one = _generate(model_dir)
    two = _generate(model_dir, "--tensor-parallel", "2")
    assert two["token_ids"] == one["token_ids"]
    assert two["text"] == one["text"]
    assert len(one["token_ids"]) > 0  # type: ignore[arg-type]


def test_generate_refuses_a_split_that_does_not_divide(model_dir: Path) -> None:
    command = [sys.executable, "-m", "dflash", "generate", "--model", str(model_dir), "--draft", "none",
               "--device", "cpu", "--prompt-ids", "5,6", "--tensor-parallel", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO)
    assert done.returncode == 2
    assert "2 key/value heads do not split evenly" in done.stderr


def test_serve_on_two_ranks_answers_and_stops_on_ctrl_c(model_dir: Path) -> None:
    from openai import OpenAI

    port = free_port()
    command = [sys.executable, "-m", "dflash", "serve", "--model", str(model_dir), "--draft", "none",
               "--device", "cpu", "--tensor-parallel", "2", "--port", str(port), "--prefix-cache-mb", "0"]
    server = subprocess.Popen(command, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read() if server.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        first = client.completions.create(model="any", prompt=[5, 17, 200, 31, 9, 64, 120], max_tokens=6)
        again = client.completions.create(model="any", prompt=[5, 17, 200, 31, 9, 64, 120], max_tokens=6)
        assert first.choices[0].text == again.choices[0].text  # greedy: the ranks stayed in step
        assert first.usage is not None and first.usage.completion_tokens > 0
        streamed = client.completions.create(model="any", prompt="Hello world", max_tokens=5, stream=True)
        assert sum(1 for _ in streamed) > 0
    finally:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole process group
        try:
            output, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    assert server.returncode == 0, output


def test_the_gpu_benchmark_runs_its_toy_shape_on_cpu_ranks(tmp_path: Path) -> None:
    """benchmarks/gpu_tensor_parallel.py --tiny --device cpu: both phases run and report every figure."""
    out = tmp_path / "tp.json"
    command = [sys.executable, "benchmarks/gpu_tensor_parallel.py", "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    for world in ("tp1", "tp2"):
        for shape in ("step", "verify16", "tree32"):
            assert report[f"{world}_{shape}_ms"] > 0
    assert report["tp2_kv_heads_per_rank"] == 1  # the toy shape's 2 key/value heads, one per rank
    assert report["ratios"]["tp2_over_tp1_step"] > 0
    assert not (tmp_path / "tp.json.tp2.json").exists()
