"""Torch calls and device reads per batched decoding step, by phase, at several request counts (CPU, tiny model).

On a GPU each torch call on the step's host path costs several microseconds of dispatch (and a kernel launch where
its tensors live on the device), and each read of a device tensor from the host (`.item()`, `.tolist()`, `int()`,
`.cpu()`) waits for the device. This counts both on the CPU, where the core runs the same code: the decoding rows
through the fixed-shape passes CUDA graphs replay (`--path padded`, run eagerly) or the packed passes.

Counted per step, by phase (the phase is the innermost core function running; `device forward` is the padded
target or drafter pass, one graph replay each on the GPU, and is left out of the host counts):

* `calls`: torch functions and tensor methods called from Python (`TorchFunctionMode`), attribute and metadata
  reads (`.shape`, `.numel()`) left out (counted as `metadata`): the host's dispatch cost;
* `device calls`: those of them that touch a device tensor (model weights, K/V pools, the padded batch's device
  buffers, choosers' tensors, and everything computed from them): kernel launches on a GPU;
* `reads`: host reads of a device tensor (a synchronisation on a GPU), with the source lines that made them;
* `h2d`: copies from a host tensor into a device tensor.

Device tensors are tracked by an attribute: the known device tensors are marked before the timed steps, and a call
that takes a marked tensor marks what it returns. A tensor created from host data with `device=` (`torch.tensor(...,
device=...)`) is not marked (on the CPU the device is the host): the source lines of such calls are listed under
`created with device=` instead.

Usage: python benchmarks/batch_step_ops.py [--requests 1,4,16] [--modes plain,ddtree] [--path padded|packed]
    [--steps 20] [--temperature 0] [--sites] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from batch_host_overhead import MODES, PROMPT_TOKENS, build_pair  # the script's folder
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from dflash.batch import graphs as graphs_module
from dflash.batch.core import BatchCore, CoreSettings
from dflash.batch.padded import PaddedBatch
from dflash.batch.sequence import Sequence
from dflash.generation.output import OutputSink
from dflash.generation.request import GenerationRequest
from dflash.generation.sampling import SamplingParams
from dflash.generation.selection import TokenChooser

# attribute reads and metadata: no kernel, a fraction of a microsecond (counted apart from the other calls)
METADATA = {"__get__", "dim", "numel", "stride", "size", "is_contiguous", "data_ptr", "element_size"}
READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"}
DEVICE_FORWARD = "device forward"
# innermost-first: the phase of a call is the innermost of these running
CORE_PHASES = {
    "_admit": "admission", "_plan_rounds": "planning", "_draft": "drafting", "_decoding_rows": "round rows",
    "_target_pass": "target pass (host)", "_choices": "choosing", "_after_round": "after round",
    "_after_prefill": "after prefill",
}


class StepOps(TorchFunctionMode):
    """Counts torch calls by phase and follows device tensors by storage."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[str] = ["step other"]
        self.calls: Counter[str] = Counter()
        self.metadata: Counter[str] = Counter()
        self.device_calls: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.h2d: Counter[str] = Counter()
        self.read_sites: Counter[str] = Counter()
        self.device_factories: Counter[str] = Counter()
        self.call_sites: Counter[str] = Counter()
        self.sites = False  # also count calls by source line (slow)
        self.counting = False

    def mark(self, *tensors: Any) -> None:
        for tensor in tree_leaves(tensors):
            if isinstance(tensor, torch.Tensor):
                tensor.on_device = True  # type: ignore[attr-defined]

    def _on_device(self, tensor: Any) -> bool:
        return isinstance(tensor, torch.Tensor) and getattr(tensor, "on_device", False)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.phases.append(name)
        try:
            yield
        finally:
            self.phases.pop()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def in_phase(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        return in_phase

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        touches_device = any(self._on_device(t) for t in inputs)
        name = getattr(func, "__name__", str(func))
        if touches_device and name not in READS:
            self.mark(result)
        if not self.counting:
            return result
        phase = self.phases[-1]
        if phase == DEVICE_FORWARD:
            return result
        if name in METADATA:
            self.metadata[phase] += 1
            return result
        self.calls[phase] += 1
        if touches_device:
            self.device_calls[phase] += 1
        if self.sites:
            self.call_sites[f"{phase}: {'device ' if touches_device else 'host '}{name} at {_caller()}"] += 1
        if name in READS and inputs and self._on_device(inputs[0]):
            self.reads[phase] += 1
            self.read_sites[f"{phase}: {name} at {_caller()}"] += 1
        if name == "copy_" and len(inputs) >= 2 and self._on_device(inputs[0]) and not self._on_device(inputs[1]):
            self.h2d[phase] += 1
        if not inputs and kwargs.get("device") is not None:
            self.device_factories[f"{phase}: {name} at {_caller()}"] += 1
        return result


def _caller() -> str:
    """The innermost frame of the repository's source (not torch's, not this file's)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/dflash/" in frame.filename and "site-packages" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
    return "?"


def instrument(core: BatchCore, ops: StepOps) -> Callable[[], None]:
    """Phases on the core's methods, the padded forwards and the sinks; returns the undo."""
    for name, label in CORE_PHASES.items():
        if hasattr(core, name):  # (`_choices`: cores that choose every round before committing any)
            setattr(core, name, ops.wrap(label, getattr(core, name)))
    target_forward, drafter_forward = graphs_module.padded_forward, graphs_module.padded_drafter_forward
    load, push = PaddedBatch.load, OutputSink.push
    init = PaddedBatch.__init__
    graphs_module.padded_forward = ops.wrap(DEVICE_FORWARD, target_forward)  # type: ignore[assignment]
    graphs_module.padded_drafter_forward = ops.wrap(DEVICE_FORWARD, drafter_forward)  # type: ignore[assignment]
    PaddedBatch.load = ops.wrap("padded load", load)  # type: ignore[method-assign]
    OutputSink.push = ops.wrap("sinks", push)  # type: ignore[method-assign]

    def marked_init(batch: PaddedBatch, *args: Any, **kwargs: Any) -> None:
        init(batch, *args, **kwargs)
        ops.mark(batch._ints, batch.visibility, batch._key_index)

    PaddedBatch.__init__ = marked_init  # type: ignore[method-assign]

    def undo() -> None:
        graphs_module.padded_forward, graphs_module.padded_drafter_forward = target_forward, drafter_forward
        PaddedBatch.load, OutputSink.push, PaddedBatch.__init__ = load, push, init  # type: ignore[method-assign]

    return undo


def new_sequence(target: torch.nn.Module, prompt: list[int], max_new: int, mode: str, temperature: float,
                 seed: int) -> Sequence:
    sampling = SamplingParams(temperature=temperature, seed=seed)
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new, sampling=sampling)
    sink = OutputSink(lambda ids: "", eos_ids=(), max_new_tokens=max_new)
    chooser = TokenChooser(sampling, eos_ids=(), min_tokens=0, vocab_size=target.config.vocab_size, device="cpu")
    return Sequence(request, mode, sink, chooser)


def count_level(mode: str, path: str, requests: int, steps: int, args: argparse.Namespace) -> dict[str, Any]:
    target, drafter = build_pair(args.vocab, args.layers, args.hidden)
    ops = StepOps()
    ops.sites = args.sites
    ops.mark(list(target.parameters()), list(target.buffers()), list(drafter.parameters()), list(drafter.buffers()))
    max_new = 64 + (steps + 5) * 17
    settings = CoreSettings(
        max_batch=requests, prefill_chunk=64, pool_tokens=requests * (PROMPT_TOKENS + max_new + 64),
        ddtree_budget=args.budget, linear_drafts=15, max_step_rows=args.max_step_rows, eager_padded=path == "padded",
    )
    with ops, torch.inference_mode():
        core = BatchCore.__new__(BatchCore)
        undo = instrument(core, ops)  # before the core is built: its graph passes take the wrapped forwards
        BatchCore.__init__(core, target, drafter, (), settings)
        ops.mark(core.target_pool.keys, core.target_pool.values)
        if core.drafter_pool is not None:
            ops.mark(core.drafter_pool.keys, core.drafter_pool.values)
        plan = core.policy.plan
        core.policy.plan = lambda *a, **k: plan(*a, **k) or True  # type: ignore[method-assign]
        core.tree_budgets.forced = True
        generator = torch.Generator().manual_seed(0)
        for index in range(requests):
            prompt = torch.randint(0, args.vocab - 1, (PROMPT_TOKENS,), generator=generator).tolist()
            seq = new_sequence(target, prompt, max_new, MODES[mode], args.temperature, index)
            ops.mark(seq.chooser.eos, seq.chooser.counts)
            core.add(seq)
        while any(seq.phase != "decode" for seq in core.active) or core.waiting:
            core.step()
        for seq in core.active:
            assert seq.target is not None
            ops.mark(seq.target._slots, seq.drafter._slots if seq.drafter is not None else None)
        for _ in range(3):
            core.step()
        ops.counting = True
        for _ in range(steps):
            assert core.step() == requests
        ops.counting = False
    undo()
    keys = ("calls", "device_calls", "reads", "h2d", "metadata")
    counters = (ops.calls, ops.device_calls, ops.reads, ops.h2d, ops.metadata)
    per_step = {
        phase: {key: round(counter[phase] / steps, 2) for key, counter in zip(keys, counters, strict=True)}
        for phase in sorted(set(ops.calls) | set(ops.metadata))
    }
    totals = {key: round(sum(p[key] for p in per_step.values()), 2) for key in keys}
    return {
        "mode": mode, "path": path, "requests": requests, "per_step": totals, "phases": per_step,
        "read_sites": {site: round(n / steps, 2) for site, n in ops.read_sites.most_common()},
        "created_with_device": {site: round(n / steps, 2) for site, n in ops.device_factories.most_common()},
        "call_sites": {site: round(n / steps, 2) for site, n in ops.call_sites.most_common()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,4,16")
    parser.add_argument("--modes", default="plain,ddtree")
    parser.add_argument("--path", choices=("padded", "packed"), default="padded")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--max-step-rows", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests")
    parser.add_argument("--sites", action="store_true", help="list the source lines of the reads and of every call")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for mode in args.modes.split(","):
        for requests in (int(n) for n in args.requests.split(",")):
            level = count_level(mode, args.path, requests, args.steps, args)
            results.append(level)
            total = level["per_step"]
            print(f"{mode:6} {args.path:6} N={requests:2}  per step: calls {total['calls']:7.1f}  device calls "
                  f"{total['device_calls']:7.1f}  reads {total['reads']:5.2f}  h2d {total['h2d']:5.2f}  metadata "
                  f"{total['metadata']:6.1f}", flush=True)
            for phase, counts in level["phases"].items():
                print(f"    {phase:20} " + "  ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
            if args.sites:
                for site, n in level["read_sites"].items():
                    print(f"      read {n:5.2f}/step  {site}")
                for site, n in level["created_with_device"].items():
                    print(f"      device= {n:5.2f}/step  {site}")
                for site, n in level["call_sites"].items():
                    print(f"      call {n:6.2f}/step  {site}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "levels": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
