"""Host time of the output sink per committed token: a round's tokens pushed one at a time against `push_many`
taking them at once (no stop string asked for), taking turns in one process on the default model's tokenizer.

Every engine step commits each decoding request's round through its sink (EOS, the token limit, stop strings, the
streamed text): at 32 clients that is 32 pushes of a few tokens a step on the engine's thread. The text is this
repository's README and architecture notes, tokenized; rounds of `--sizes` tokens. Both ways must give the same
tokens, text and streamed text (checked every repeat).

    python benchmarks/output_sink_rounds.py --out results/output_sink_rounds.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from dflash.bench.provenance import provenance, write_result
from dflash.engine.loading import LoadOptions, load_engine
from dflash.generation.output import OutputSink
from dflash.tokenizer import Tokenizer

TEXT_FILES = ("README.md", "docs/ARCHITECTURE.md")


def push_seconds(tokenizer: Tokenizer, ids: list[int], size: int, at_once: bool) -> tuple[float, tuple[object, ...]]:
    """Seconds to push `ids` in rounds of `size`, and what the sink ended with (tokens, text, streamed text)."""
    streamed: list[str] = []
    sink = OutputSink(tokenizer.decode, eos_ids=(), max_new_tokens=len(ids) + 1,
                      on_text=lambda text, _: streamed.append(text))
    started = time.perf_counter()
    for start in range(0, len(ids), size):
        chunk = ids[start : start + size]
        if at_once:
            sink.push_many(chunk)
        else:
            for token in chunk:
                sink.push(token)
    took = time.perf_counter() - started
    sink.finish_cancelled()
    return took, (sink.token_ids, sink.text, "".join(streamed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,2,3,5,8", help="tokens a round, comma-separated")
    parser.add_argument("--repeats", type=int, default=9, help="turns per size (the median is kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    engine = load_engine("default", "none", loading=LoadOptions(device="cpu"))
    tokenizer = engine.tokenizer
    text = "".join(Path(name).read_text(encoding="utf-8") for name in TEXT_FILES)
    ids = tokenizer.encode(text)[:6000]
    figures = {}
    for size in (int(s) for s in args.sizes.split(",")):
        alone: list[float] = []
        at_once: list[float] = []
        for _ in range(args.repeats):
            one, ended = push_seconds(tokenizer, ids, size, at_once=False)
            many, ended_many = push_seconds(tokenizer, ids, size, at_once=True)
            assert ended == ended_many, f"rounds of {size}: the two ways differ"
            alone.append(one)
            at_once.append(many)
        per_token = (statistics.median(alone) / len(ids) * 1e6, statistics.median(at_once) / len(ids) * 1e6)
        figures[f"{size}_tokens_a_round"] = {
            "one_at_a_time_us_per_token": round(per_token[0], 2),
            "at_once_us_per_token": round(per_token[1], 2),
            "speedup": round(per_token[0] / per_token[1], 3),
        }
        print(size, figures[f"{size}_tokens_a_round"], flush=True)
    result = {
        **provenance(engine.device),
        "what": "output sink host time per committed token, a round pushed one token at a time against at once",
        "tokens": len(ids),
        "text": list(TEXT_FILES),
        "repeats": args.repeats,
        "figures": figures,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
