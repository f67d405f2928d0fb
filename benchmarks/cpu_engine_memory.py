"""Resident memory of the default engine on the CPU: after importing torch, after loading (target and drafter), the
loading's peak, and after one 128-token greedy generation (`/proc/self/status`, `ru_maxrss`), as JSON on stdout;
and whether loading imported torch's compiler stack (torch._dynamo).

Usage: python benchmarks/cpu_engine_memory.py
"""

from __future__ import annotations

import importlib
import json
import resource
import sys


def resident_mib() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, MiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS", "RssAnon", "RssFile")):
                fields[line.split(":")[0]] = int(line.split()[1]) // 1024
    return fields


def peak_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def main() -> int:
    importlib.import_module("torch")
    imported = resident_mib()
    from dflash.engine.loading import load_engine
    from dflash.generation.request import GenerationRequest
    from dflash.generation.sampling import SamplingParams

    engine = load_engine("default", "default")
    loaded, loading_peak = resident_mib(), peak_mib()
    ids = engine.tokenizer.encode("Write a Python function that reverses a string.")
    engine.generate(GenerationRequest(prompt_ids=list(ids), max_new_tokens=128, ignore_eos=True,
                                      sampling=SamplingParams(temperature=0.0)))
    print(json.dumps({
        "after_import_torch_mib": imported, "after_load_mib": loaded, "peak_during_load_mib": loading_peak,
        "after_128_tokens_mib": resident_mib(), "peak_mib": peak_mib(),
        "compiler_stack_loaded": "torch._dynamo" in sys.modules,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
