"""llama.cpp as a peer of `dflash bench speed` (`dflash.bench.llama_cpp_peer`): finding llama-bench, refusing a
model llama-bench cannot read, the command it is given, its JSON output, its failures and its peak memory, all
through a stand-in executable that prints a real llama-bench output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash import environment
from dflash.bench.llama_cpp_peer import (
    LlamaBenchPeer,
    LlamaBenchRun,
    find_llama_bench,
    gguf_model_file,
    mean_prompt_tokens,
    parse_llama_bench_json,
    prepare_peer,
    run_llama_bench,
)
from dflash.errors import DFlashError
from tests.llama_bench_stand_in import REAL_OUTPUT, real_output, write_stand_in


def _gguf(tmp_path: Path) -> Path:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # only its name and existence matter before llama-bench reads it
    return model


def _run(binary: Path, model: Path, *, gpu: bool = False, extra: tuple[str, ...] = ()) -> LlamaBenchRun:
    return LlamaBenchRun(LlamaBenchPeer(binary, model, extra), threads=3, prompt_tokens=57, gen_tokens=64,
                         repetitions=2, gpu=gpu)


def test_the_command_matches_the_run(tmp_path: Path) -> None:
    binary, model = tmp_path / "llama-bench", tmp_path / "m.gguf"
    cpu = _run(binary, model, extra=("--repack", "0")).command()
    assert cpu == [str(binary), "-m", str(model), "-t", "3", "-p", "57", "-n", "64", "-r", "2", "-ngl", "0",
                   "-o", "json", "--repack", "0"]
    gpu = _run(binary, model, gpu=True).command()
    assert gpu[gpu.index("-ngl") + 1] == "99" and gpu[gpu.index("-fa") + 1] == "1" and "--repack" not in gpu


def test_the_executable_comes_from_the_flag_then_the_environment_then_path(tmp_path: Path) -> None:
    flagged, _ = write_stand_in(tmp_path)
    on_path = tmp_path / "bin"
    on_path.mkdir()
    listed, _ = write_stand_in(on_path)
    from_env = tmp_path / "env-bench"
    from_env.write_bytes(flagged.read_bytes())
    from_env.chmod(0o755)
    env = {environment.LLAMA_BENCH: str(from_env), "PATH": str(on_path)}
    assert find_llama_bench(str(flagged), env) == flagged
    assert find_llama_bench(None, env) == from_env
    assert find_llama_bench(None, {"PATH": str(on_path)}) == listed
    with pytest.raises(DFlashError) as missing:
        find_llama_bench(None, {"PATH": str(tmp_path / "empty")})
    assert all(way in str(missing.value) for way in ("--llama-bench", environment.LLAMA_BENCH, "PATH"))
    with pytest.raises(DFlashError, match="not an executable file"):
        find_llama_bench(str(tmp_path / "nowhere"), env)


def test_a_model_llama_bench_cannot_read_is_refused(tmp_path: Path) -> None:
    assert gguf_model_file(str(_gguf(tmp_path))) == tmp_path / "model.gguf"
    (tmp_path / "hf").mkdir()
    with pytest.raises(DFlashError, match="must be a GGUF file"):
        gguf_model_file(str(tmp_path / "hf"))
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(DFlashError, match="must be a GGUF file"):
        prepare_peer(str(tmp_path / "weights.safetensors"), write_stand_in(tmp_path)[0])


def test_prompt_length_is_the_runs_mean() -> None:
    assert mean_prompt_tokens([[1] * 10, [1] * 15]) == 12  # 12.5 rounds to even
    assert mean_prompt_tokens([[1] * 10, [1] * 17]) == 14
    assert mean_prompt_tokens([]) == 128


def test_the_real_output_parses_into_its_two_tests() -> None:
    parsed = parse_llama_bench_json(REAL_OUTPUT.read_text())
    pp, tg = real_output()
    assert parsed.prompt.tokens == pp["n_prompt"] and parsed.decode.tokens == tg["n_gen"]
    assert parsed.decode.samples_ts == tuple(tg["samples_ts"]) and parsed.decode.avg_ts == tg["avg_ts"]
    # the median of the repetitions, the statistic our modes report (two samples: their mean, not llama-bench's avg)
    assert parsed.decode.median_ts == pytest.approx(sum(tg["samples_ts"]) / 2)
    assert parsed.info["build_commit"] == tg["build_commit"] and parsed.info["n_threads"] == tg["n_threads"]


@pytest.mark.parametrize("text", ["not json", json.dumps({"n_gen": 1}), json.dumps(real_output()[:1])])
def test_unusable_output_is_a_clear_error(text: str) -> None:
    with pytest.raises(DFlashError, match="llama-bench"):
        parse_llama_bench_json(text)


def test_a_run_reports_figures_command_build_and_its_own_peak_memory(tmp_path: Path) -> None:
    binary, argv_file = write_stand_in(tmp_path, ballast_mib=48)
    model = _gguf(tmp_path)
    # neither an earlier, bigger child (RUSAGE_CHILDREN reports the largest) nor this process's own resident size
    # (over 200 MiB with torch; a child forked from here starts its high-water mark from it) may count
    subprocess.run([sys.executable, "-c", "b = b'x' * (160 * 2**20)"], check=True)
    report = run_llama_bench(_run(binary, model, extra=("--repack", "0")))
    assert json.loads(argv_file.read_text()) == _run(binary, model, extra=("--repack", "0")).command()[1:]
    pp, tg = real_output()
    assert report["decode"]["samples_ts"] == tg["samples_ts"] and report["prompt"]["tokens"] == pp["n_prompt"]
    assert report["command"].startswith(f"{binary} -m {model} -t 3")
    assert report["build_commit"] == tg["build_commit"] and report["cpu_info"] == tg["cpu_info"]
    assert 48 <= report["peak_rss_mib"] < 160


def test_a_failing_llama_bench_is_a_clear_error(tmp_path: Path) -> None:
    binary, _ = write_stand_in(tmp_path, output="", exit_code=3, stderr="error: failed to load model\n")
    with pytest.raises(DFlashError, match="exited with status 3") as failed:
        run_llama_bench(_run(binary, _gguf(tmp_path)))
    assert "failed to load model" in str(failed.value) and str(binary) in str(failed.value)
    crashing, _ = write_stand_in(tmp_path, signal_name="SIGSEGV")
    with pytest.raises(DFlashError, match="killed by SIGSEGV"):
        run_llama_bench(_run(crashing, _gguf(tmp_path)))


def test_the_cli_refuses_a_missing_llama_bench_before_loading(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != environment.LLAMA_BENCH}
    env["PATH"] = str(tmp_path)  # no llama-bench there; the interpreter is named by its full path
    done = subprocess.run(
        [sys.executable, "-m", "dflash", "bench", "speed", "--model", str(_gguf(tmp_path)), "--modes", "llama.cpp,ar"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: the llama.cpp mode needs llama.cpp's llama-bench" in done.stderr


@pytest.mark.slow
def test_bench_speed_runs_llama_bench_on_the_engines_gguf(tmp_path: Path) -> None:
    from dflash.models.resolve import resolve_model_path
    from dflash.training.prompts import write_prompt_file

    binary, argv_file = write_stand_in(tmp_path)
    prompts, out_file = tmp_path / "prompts.jsonl", tmp_path / "speed.json"
    write_prompt_file(prompts, ["Name three colours.", "Write a Python function that adds two numbers."])
    args = ["bench", "speed", "--prompts-file", str(prompts), "--modes", "ar,llama.cpp", "--max-tokens", "8",
            "--runs", "1", "--threads", "1", "--llama-bench", str(binary), "--llama-bench-args=--repack 0",
            "--json", "--out", str(out_file)]
    done = subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    argv = json.loads(argv_file.read_text())
    given = dict(zip(argv[0::2], argv[1::2], strict=True))
    assert given["-m"] == str(resolve_model_path("default"))  # the very file the engine loaded
    assert (given["-t"], given["-n"], given["-r"], given["-ngl"], given["-o"]) == ("1", "8", "1", "0", "json")
    assert int(given["-p"]) > 5 and given["--repack"] == "0"
    saved = json.loads(out_file.read_text())
    assert list(saved["modes"]) == ["ar", "llama.cpp"] and saved["threads"] == 1
    ar, peer = saved["modes"]["ar"], saved["modes"]["llama.cpp"]
    assert ar["decode_tokens_per_s"] > 0 and ar["prefill_tokens_per_s"] > 0
    tg = real_output()[1]
    assert peer["decode_tokens_per_s"] == pytest.approx(sum(tg["samples_ts"]) / 2, abs=1e-3)
    assert saved["ratios"]["ar/llama.cpp"] == pytest.approx(ar["decode_tokens_per_s"] / peer["decode_tokens_per_s"],
                                                            rel=1e-2)
    assert saved["llama_cpp"]["command"] == " ".join([str(binary), *argv])
    memory = saved["peak_rss_mib"]
    assert memory["ours"] > 0 and memory["llama.cpp"] > 0
    assert memory["ours/llama.cpp"] == pytest.approx(memory["ours"] / memory["llama.cpp"], rel=1e-2)
