"""Weight panels (`kernels/int8_panels.h`) against GGUF rows for the int8 products, in one process.

Loads the default engine on the CPU and, taking turns (`DFLASH_CPU_PANELS` 1, then 0, every quantized matrix of the
target, the drafter and the drafter's shortlist head moved to that layout; `--repeats` times), times what
`cpu_native_layers.py` times: a plain step, a verification of `--rows` rows, whole greedy generations in plain
decoding and in DDTree speculating every round (and the median drafter round); checks that both layouts give the
same tokens. Then the model's product chain alone (every matrix of one forward) at 1, 4, 8 and 16 input rows in
both layouts and both input roundings, taking turns.

    python benchmarks/cpu_weight_panels.py --out results/cpu_weight_panels_epyc_avx512.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from cpu_native_layers import add_arguments, compare_ways  # benchmarks/ is the folder

from dflash.bench.provenance import write_result
from dflash.engine.engine import Engine, EngineOptions
from dflash.engine.loading import load_engine
from dflash.kernels.build import load_int8_kernel
from dflash.models.cpu_matmul import draft_products, use_cpu_matmul
from dflash.models.quantized_layers import PANEL_FORMATS, QuantizedLinear

SWITCH = "DFLASH_CPU_PANELS"


def arrange(engine: Engine, flag: str) -> Callable[[], None]:
    """A call that puts every quantized matrix of the engine in the layout `flag` asks for."""

    def switch() -> None:
        os.environ[SWITCH] = flag
        kind = engine.cpu_matmul
        assert kind is not None
        use_cpu_matmul(engine.target, kind)
        drafter = engine.drafter
        if drafter is not None:
            use_cpu_matmul(drafter, draft_products(kind))
            head = getattr(drafter.draft_head, "rows", None)
            if isinstance(head, QuantizedLinear):
                head.use_products(head.products)
        matrices = [m for m in engine.target.modules() if isinstance(m, QuantizedLinear)]
        assert all(m.panels == (flag == "1") for m in matrices if m.qtype in PANEL_FORMATS)

    return switch


def chain_ms(engine: Engine, ways: dict[str, Callable[[], None]], rows: list[int], repeats: int) -> dict[str, float]:
    """way/parts/rows -> median ms of the target's product chain (every matrix once) over `repeats` turns."""
    matrices = [m for m in engine.target.modules() if isinstance(m, QuantizedLinear)]
    kernel = load_int8_kernel()
    times: dict[str, list[float]] = {}
    for _ in range(repeats + 1):  # the first turn warms up
        for way, switch in ways.items():
            switch()
            for parts in (1, 2):
                for count in rows:
                    inputs = [torch.randn(count, m.in_features) for m in matrices]
                    started = time.perf_counter()
                    for m, x in zip(matrices, inputs, strict=True):
                        if m.panels:
                            kernel.panel_matmul(x, m.blocks, m.qtype, m.out_features, parts)
                        else:
                            kernel.matmul(x, m.blocks, m.qtype, True, parts)
                    times.setdefault(f"{way}/parts_{parts}/{count}_rows", []).append(time.perf_counter() - started)
    return {name: round(1000 * statistics.median(values[1:]), 3) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--chain-rows", default="1,4,8,16")
    args = parser.parse_args()
    engine = load_engine("default", options=EngineOptions(max_batch=1, spec="ddtree", always_speculate=True))
    engine.warm_up()
    ways = {"panels": arrange(engine, "1"), "rows": arrange(engine, "0")}
    result = compare_ways(engine, ways, args, "cpu_weight_panels.py")
    result["isa"] = load_int8_kernel().isa()
    result["product_chain_ms"] = chain_ms(engine, ways, [int(r) for r in args.chain_rows.split(",")], args.repeats)
    os.environ.pop(SWITCH, None)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
