"""`dflash serve` end to end under concurrent chat clients, as a user runs it: start-up, answers, speed, memory.

For each server configuration (the default flags, then each `--variant`) this starts `dflash serve` in a process of
its own with the flags after `--`, and times its start (launch to the first 200 from `/health`: loading and the
warm-up's graph captures). Clients are the official OpenAI SDK, streaming `POST /v1/chat/completions` (greedy, the
prompts of `--prompts`, `max_tokens` `--max-tokens`). First every prompt is sent alone, one after another; then the
same prompts `--rounds` times by `--clients` clients at once. Per configuration: the start time, the answers'
tokens/s alone and together (tokens over the wall time of the whole wave), each request's TTFT and latency, how
many answers were the same together as alone (greedy decoding: a batch must not change them; in float16/bfloat16
a different kernel order may flip a near tie, so this is counted, not asserted), the `/metrics` batch sizes, and the
GPU memory the server's process holds (`nvidia-smi`, where present).

Usage: python benchmarks/server_concurrency.py OUT.json [--clients 8] [--rounds 2] [--max-tokens 128]
    [--prompts benchmarks/prompts/mtbench.jsonl] [--variant "--max-concurrency 1"] -- <dflash serve flags>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int
    ttft_s: float
    latency_s: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> float:
    """Seconds until `/health` answers 200 (the process's launch is time 0 for the caller)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic()
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s")


def ask(client: Any, prompt: str, max_tokens: int) -> Answer:
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    tokens = 0
    stream = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(choice.delta.content)
    ended = time.perf_counter()
    return Answer("".join(parts), tokens, (first or ended) - started, ended - started)


def wave(client: Any, prompts: list[str], clients: int, max_tokens: int) -> tuple[list[Answer], float]:
    """Every prompt, `clients` at a time; the wave's answers in prompt order and its wall time."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda p: ask(client, p, max_tokens), prompts))
    return answers, time.perf_counter() - started


def gpu_memory_mib(pid: int) -> int | None:
    """GPU memory held by process `pid` (nvidia-smi), None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1])
    return 0


def gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def metric_lines(url: str, prefix: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [line for line in text.splitlines() if line.startswith(prefix)]


def summary(answers: list[Answer], wall_s: float) -> dict[str, Any]:
    tokens = sum(a.tokens for a in answers)
    return {
        "requests": len(answers), "tokens": tokens, "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1),
        "ttft_s_p50": round(statistics.median(a.ttft_s for a in answers), 4),
        "ttft_s_max": round(max(a.ttft_s for a in answers), 4),
        "latency_s_p50": round(statistics.median(a.latency_s for a in answers), 4),
        "latency_s_max": round(max(a.latency_s for a in answers), 4),
    }


def run_configuration(serve_flags: list[str], args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    from openai import OpenAI

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = args.out.with_suffix(f".{port}.log")
    command = [sys.executable, "-m", "dflash", "-v", "serve", "--port", str(port), *serve_flags]
    launched = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            ready_s = wait_ready(url, process, args.start_timeout) - launched
            client = OpenAI(base_url=f"{url}/v1", api_key="dummy", max_retries=0, timeout=600)
            alone_started = time.perf_counter()
            alone = [ask(client, p, args.max_tokens) for p in prompts]
            alone_wall = time.perf_counter() - alone_started
            memory_alone = gpu_memory_mib(process.pid)
            waves = [wave(client, prompts, args.clients, args.max_tokens) for _ in range(args.rounds)]
            memory_together = gpu_memory_mib(process.pid)
            batch_metrics = metric_lines(url, "dflash_batch_size")
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    log_lines = log_path.read_text(errors="replace").splitlines()
    log_path.unlink()
    same = [sum(a.text == b.text for a, b in zip(alone, answers, strict=True)) for answers, _ in waves]
    return {
        "serve_flags": serve_flags,
        "ready_s": round(ready_s, 2),
        "alone": summary(alone, alone_wall),
        "together": [summary(answers, wall) for answers, wall in waves],
        "same_answer_as_alone": same,
        "gpu_memory_mib": {"after_alone": memory_alone, "after_together": memory_together},
        "batch_size_metrics": batch_metrics,
        "server_log": [line for line in log_lines if "decoding at once" in line or "one request at a time" in line],
        "graphs_captured_logged": sum("captured" in line for line in log_lines),
        "alone_latency_s": [round(a.latency_s, 3) for a in alone],
        "answers_alone": [asdict(a) | {"text": a.text[:80]} for a in alone[:2]],
    }


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parent / "prompts" / "mtbench.jsonl")
    parser.add_argument("--requests", type=int, default=None, help="prompts used (default: 4 x --clients)")
    parser.add_argument("--variant", action="append", default=[], help="extra serve flags of another run")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    args = parser.parse_args(argv[:split])
    serve_flags = argv[split + 1:]
    lines = args.prompts.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.requests or 4 * args.clients]
    runs = []
    for extra in ["", *args.variant]:
        flags = [*serve_flags, *shlex.split(extra)]
        runs.append(run_configuration(flags, args, prompts))
        print(json.dumps({k: runs[-1][k] for k in ("serve_flags", "ready_s", "alone", "together",
                                                    "same_answer_as_alone", "gpu_memory_mib")}), flush=True)
    result = {
        "what": "dflash serve under concurrent streaming chat clients (official OpenAI SDK), start to answers",
        "command": "python benchmarks/server_concurrency.py " + " ".join(shlex.quote(a) for a in argv),
        "date": time.strftime("%Y-%m-%d"), "gpus": gpu_names(), "python": platform.python_version(),
        "torch": torch_version(),
        "clients": args.clients, "max_tokens": args.max_tokens, "prompts": str(args.prompts.name),
        "requests_per_wave": len(prompts), "cpu_count": os.cpu_count(), "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
