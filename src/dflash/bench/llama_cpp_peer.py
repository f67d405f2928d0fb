"""llama.cpp as a peer of `dflash bench speed`: its `llama-bench` run on the same GGUF file, threads and lengths.

`llama-bench` times two tests in one process: `pp` (a prompt of `-p` tokens in one batch: prompt processing) and
`tg` (`-n` tokens generated one at a time from an empty context: pure decode, no prompt), each `-r` times after its
own warm-up. Its `-o json` output is a list with one object per test (`n_prompt`, `n_gen`, `avg_ts`, `stddev_ts`,
`samples_ts`, `build_commit`, `cpu_info`, `n_threads`, ...). The peak resident memory of the `llama-bench` process
is its `ru_maxrss`, read by a small launcher that waits for it alone (see `_LAUNCHER` for why not from here).

The executable is `--llama-bench PATH`, else `DFLASH_LLAMA_BENCH`, else `llama-bench` on PATH.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash import environment
from dflash.errors import DFlashError
from dflash.models.resolve import resolve_model_path

LLAMA_CPP_MODE = "llama.cpp"
DEFAULT_PROMPT_TOKENS = 128  # llama-bench's pp length when the run has no prompts to take it from
_STDERR_TAIL_LINES = 12


@dataclass(frozen=True)
class LlamaBenchPeer:
    """What is known before the run: the executable, the GGUF file the engine loads, extra arguments."""

    binary: Path
    model: Path
    extra_args: tuple[str, ...] = ()  # appended as given (`--llama-bench-args`), e.g. "--repack 0"


@dataclass(frozen=True)
class LlamaBenchRun:
    """One `llama-bench` invocation, shaped like the speed run it is compared with."""

    peer: LlamaBenchPeer
    threads: int
    prompt_tokens: int  # -p: the mean prompt length of the run's prompts
    gen_tokens: int  # -n: the run's --max-tokens
    repetitions: int  # -r: the run's --runs
    gpu: bool  # the engine runs on CUDA: every layer offloaded, flash attention on

    def command(self) -> list[str]:
        # -ngl 0 on the CPU: a GPU build of llama-bench would otherwise offload layers (its default, -1, does)
        offload = ["-ngl", "99", "-fa", "1"] if self.gpu else ["-ngl", "0"]
        return [
            str(self.peer.binary), "-m", str(self.peer.model), "-t", str(self.threads),
            "-p", str(self.prompt_tokens), "-n", str(self.gen_tokens), "-r", str(self.repetitions),
            *offload, "-o", "json", *self.peer.extra_args,
        ]


@dataclass(frozen=True)
class LlamaBenchTest:
    """One test of llama-bench's output: tokens/s per repetition and llama-bench's own summary of them."""

    tokens: int  # n_prompt for pp, n_gen for tg
    samples_ts: tuple[float, ...]
    avg_ts: float
    stddev_ts: float

    @property
    def median_ts(self) -> float:
        """The statistic our modes report (median of the repetitions)."""
        return statistics.median(self.samples_ts) if self.samples_ts else self.avg_ts

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_per_s": round(self.median_ts, 3), "avg_ts": round(self.avg_ts, 3),
                "stddev_ts": round(self.stddev_ts, 3), "samples_ts": list(self.samples_ts)}


@dataclass(frozen=True)
class LlamaBenchOutput:
    prompt: LlamaBenchTest  # pp: prompt processing
    decode: LlamaBenchTest  # tg: generation from an empty context
    info: dict[str, Any]  # build_commit, cpu_info, n_threads ... as llama-bench reports them


_INFO_FIELDS = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_type", "model_size",
                "n_threads", "n_gpu_layers", "flash_attn", "type_k", "type_v", "n_batch", "n_ubatch")


def find_llama_bench(flag: str | Path | None, env: Mapping[str, str] | None = None) -> Path:
    """The executable: `flag` (`--llama-bench`), else `DFLASH_LLAMA_BENCH`, else `llama-bench` on PATH."""
    for origin, given in (("--llama-bench", flag), (environment.LLAMA_BENCH, environment.llama_bench(env))):
        if given:
            path = Path(given).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise DFlashError(f"{origin} {path}: not an executable file")
            return path
    found = shutil.which("llama-bench", path=None if env is None else env.get("PATH", os.defpath))
    if found is None:
        raise DFlashError(
            "the llama.cpp mode needs llama.cpp's llama-bench: give --llama-bench PATH, set "
            f"{environment.LLAMA_BENCH}=PATH, or put llama-bench on PATH"
        )
    return Path(found)


def gguf_model_file(model_arg: str) -> Path:
    """The GGUF file `--model` names; llama-bench reads only GGUF, so anything else is refused."""
    path = resolve_model_path(model_arg)
    if path.is_dir() or path.suffix.lower() != ".gguf":
        raise DFlashError(
            f"the llama.cpp mode runs llama-bench on the engine's own model file, which must be a GGUF file; "
            f"--model {model_arg} is {path}"
        )
    return path


def prepare_peer(model_arg: str, flag: str | Path | None = None, extra_args: str = "",
                 env: Mapping[str, str] | None = None) -> LlamaBenchPeer:
    """Check what can be checked before the engine loads (the executable, the GGUF file)."""
    return LlamaBenchPeer(find_llama_bench(flag, env), gguf_model_file(model_arg), tuple(shlex.split(extra_args)))


def mean_prompt_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """llama-bench's -p: the run's mean prompt length, rounded (128 without prompts)."""
    if not prompts:
        return DEFAULT_PROMPT_TOKENS
    return max(1, round(sum(len(p) for p in prompts) / len(prompts)))


def parse_llama_bench_json(text: str) -> LlamaBenchOutput:
    """The pp and tg tests of `llama-bench -o json` output."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DFlashError(f"llama-bench printed no JSON list ({exc}); output starts: {text[:200]!r}") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise DFlashError(f"llama-bench's JSON is not a list of tests: {text[:200]!r}")
    prompt = [t for t in tests if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0]
    decode = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if len(prompt) != 1 or len(decode) != 1:
        raise DFlashError(f"expected one pp and one tg test in llama-bench's output, found {len(prompt)} pp and "
                          f"{len(decode)} tg among {len(tests)} tests")
    info = {name: decode[0][name] for name in _INFO_FIELDS if name in decode[0]}
    return LlamaBenchOutput(_test(prompt[0], "n_prompt"), _test(decode[0], "n_gen"), info)


def _test(entry: dict[str, Any], length_field: str) -> LlamaBenchTest:
    try:
        return LlamaBenchTest(
            tokens=int(entry[length_field]), samples_ts=tuple(float(v) for v in entry.get("samples_ts", [])),
            avg_ts=float(entry["avg_ts"]), stddev_ts=float(entry.get("stddev_ts", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DFlashError(f"llama-bench test without a usable {exc} field: {entry}") from None


def run_llama_bench(run: LlamaBenchRun) -> dict[str, Any]:
    """Run llama-bench; its figures, the exact command, its build and its peak resident memory."""
    command = run.command()
    with tempfile.TemporaryDirectory(prefix="llama-bench-") as folder:
        files = Path(folder)
        usage_file = files / "usage"
        with open(files / "stdout", "wb") as stdout, open(files / "stderr", "wb") as stderr:
            launched = subprocess.run([sys.executable, "-I", "-S", "-c", _LAUNCHER, str(usage_file), *command],
                                      stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, check=False)
        out = (files / "stdout").read_text(errors="replace")
        err = (files / "stderr").read_text(errors="replace")
        usage = usage_file.read_text().split() if usage_file.is_file() else []
    tail = "".join(f"\n{line}" for line in err.strip().splitlines()[-_STDERR_TAIL_LINES:])
    if len(usage) != 2:
        raise DFlashError(f"llama-bench could not be run (launcher status {launched.returncode}): "
                          f"{shlex.join(command)}{tail}")
    maxrss, code = int(usage[0]), int(usage[1])
    if code != 0:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        raise DFlashError(
            f"llama-bench {how}: {shlex.join(command)}{tail}\n"
            "(extra llama-bench arguments can be given with --llama-bench-args)"
        )
    figures = parse_llama_bench_json(out)
    return {
        "command": shlex.join(command),
        **figures.info,
        "prompt": figures.prompt.as_dict(),
        "decode": figures.decode.as_dict(),
        "peak_rss_mib": round(maxrss_mib(maxrss), 1),
    }


# llama-bench starts from a small launcher that reports the child's exit status and ru_maxrss (from its own wait4).
# Not from this process: on Linux a child's ru_maxrss starts from the resident size of the address space it was
# forked from (exec keeps the old one's high-water mark), so a llama-bench forked from a process holding a model
# and torch would report at least that process's peak. From the launcher it reports max(the launcher's ~8 MiB, its
# own peak).
_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[2], sys.argv[2:])
    except OSError as exc:
        os.write(2, f"cannot start {sys.argv[2]}: {exc}\\n".encode())
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def maxrss_mib(ru_maxrss: int) -> float:
    """`ru_maxrss` in MiB: Linux counts KiB, macOS bytes."""
    return ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
