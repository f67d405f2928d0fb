"""dflash against llama.cpp CUDA on the same GGUF file and GPU: plain decoding and prompt processing, one run.

For each GGUF file (e.g. a random-weight Qwen3-8B-shaped Q4_K_M from `dflash bench make-gguf`):
* dflash, one engine per weight form (`--weights dense`: the blocks dequantised to bf16; `quantized`: the GGUF's
  4-bit matrices kept as words, other formats as blocks), plain decoding (no drafter), CUDA graphs: decode tokens/s
  of `--gen` tokens after a `--short`-token prompt (greedy, EOS ignored; `GenerationStats.tokens_per_s`) and prompt
  tokens/s of a `--prompt`-token prompt (`prefill_s`, read after a device sync), the median of `--runs` after one
  warm-up generation of each;
* llama.cpp: `llama-bench -p PROMPT -n GEN -r RUNS -ngl 99 -fa 1` (`dflash.bench.llama_cpp_peer`): tg (decode from
  an empty context) and pp tokens/s, the median of its repetitions.
Prompts are random token ids (the weights are random: only the cost matters). Writes `rows`, one object per
(model, quant, engine, weights) with `decode_tok_s` and `prefill_tok_s`, and the ratios to llama.cpp.

Usage: python benchmarks/gpu_gguf_peers.py --model FILE.gguf[,FILE2.gguf] --llama-bench PATH --out FILE
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dflash.bench.llama_cpp_peer import LlamaBenchPeer, LlamaBenchRun, run_llama_bench
from dflash.engine.engine import EngineOptions
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams


def dflash_row(path: Path, weights: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = load_engine(str(path), "none", options=EngineOptions(max_batch=1), loading=LoadOptions(weights=weights))
    vocab = engine.target.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def request(tokens: int, new: int) -> GenerationRequest:
        ids = torch.randint(10, vocab - 10, (tokens,), generator=generator).tolist()
        return GenerationRequest(prompt_ids=ids, max_new_tokens=new, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0.0))

    engine.generate(request(args.short, args.gen))  # warm-up: graphs captured, kernels compiled
    engine.generate(request(args.prompt, 1))
    decode = [engine.generate(request(args.short, args.gen)).stats.tokens_per_s for _ in range(args.runs)]
    prefill = []
    for _ in range(args.runs):
        stats = engine.generate(request(args.prompt, 1)).stats
        prefill.append(stats.prompt_tokens / stats.prefill_s)
    row = {
        "engine": "dflash", "weights": weights, "decode_tok_s": round(statistics.median(decode), 1),
        "prefill_tok_s": round(statistics.median(prefill), 1), "decode_samples": [round(v, 1) for v in decode],
        "prefill_samples": [round(v, 1) for v in prefill],
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def llama_row(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    run = LlamaBenchRun(LlamaBenchPeer(Path(args.llama_bench), path), threads=args.threads, prompt_tokens=args.prompt,
                        gen_tokens=args.gen, repetitions=args.runs, gpu=True)
    result = run_llama_bench(run)
    return {"engine": "llama.cpp", "weights": "gguf", "decode_tok_s": result["decode"]["tokens_per_s"],
            "prefill_tok_s": result["prompt"]["tokens_per_s"], "llama_bench": result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF files, comma-separated")
    parser.add_argument("--name", default="", help="model names for the rows, comma-separated (default: file stems)")
    parser.add_argument("--quant", default="", help="their quantization mixes, comma-separated")
    parser.add_argument("--llama-bench", default="", help="llama.cpp's llama-bench (CUDA build); empty: not run")
    parser.add_argument("--weights", default="quantized,dense")
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    files = [Path(f) for f in args.model.split(",")]
    names = args.name.split(",") if args.name else [f.stem for f in files]
    quants = args.quant.split(",") if args.quant else [""] * len(files)
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "benchmark": "gpu_gguf_peers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                     "triton": __import__("triton").__version__},
        "command": " ".join(["python", "benchmarks/gpu_gguf_peers.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {"gen": args.gen, "short_prompt": args.short, "prompt": args.prompt, "runs": args.runs},
        "rows": rows,
    }
    for path, name, quant in zip(files, names, quants, strict=True):
        found: list[dict[str, Any]] = []
        for weights in args.weights.split(","):
            try:
                found.append(dflash_row(path, weights, args))
            except Exception as exc:  # one failing form must not lose the others
                found.append({"engine": "dflash", "weights": weights, "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(json.dumps(found[-1])[:300], flush=True)
        if args.llama_bench:
            try:
                found.append(llama_row(path, args))
            except Exception as exc:
                found.append({"engine": "llama.cpp", "error": f"{type(exc).__name__}: {exc}"[:600]})
            print(json.dumps(found[-1])[:300], flush=True)
        peer = next((r for r in found if r["engine"] == "llama.cpp" and "decode_tok_s" in r), None)
        for row in found:
            row.update(model=name, quant=quant)
            if peer is not None and row["engine"] == "dflash" and "decode_tok_s" in row:
                row["decode_over_llama_cpp"] = round(row["decode_tok_s"] / peer["decode_tok_s"], 3)
                row["prefill_over_llama_cpp"] = round(row["prefill_tok_s"] / peer["prefill_tok_s"], 3)
        rows.extend(found)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
