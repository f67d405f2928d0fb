"""Scale study on one GPU: a Qwen3-8B-shaped target and a published-shape DFlash drafter with random weights.

Measures, in one run and on the same device:
* copy bandwidth (device to device, bytes read + written per second);
* the pure weight-streaming chain: every weight matrix of the target multiplied once, nothing else, captured
  in a CUDA graph (the practical floor of one decoding step), at 1, 16 and 64 tokens;
* our target forward at 1 token (one decoding step), 16 tokens (linear verify) and tree verify at budgets 32 and 64
  (ancestor mask), at 2K and 16K context, both eager and replayed from a CUDA graph captured at that cache length;
* the drafter's round (new context rows + one 16-slot block + LM head on 15 rows), eager and graphed;
* the same shapes through the product's `GraphRunner` (`*_runner_ms`: host input copies, the replay of the graph
  captured for that shape and bucket, output copies), which is what decoding runs; the bars use these.
Then a projection of tokens/s from published acceptance lengths, labelled as such.

Usage: python benchmarks/gpu_scale_study.py --out results/gpu_scale_study_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.config import ModelConfig
from dflash.drafter.int8 import quantize_drafter_int8
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.fastpath.runner import GraphRunner, attach_graph_runner
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES
from dflash.models.rope import Rotary

DTYPE = torch.bfloat16
# published acceptance lengths of DFlash drafters on Qwen3-8B (greedy), for the projection only
PUBLISHED_TAU = {"HumanEval": 6.5, "MT-Bench": 4.3}


def target_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, layer_types=("full_attention",) * 36, qk_norm=True,
    )


def drafter_config() -> DrafterConfig:
    return DrafterConfig(
        block_size=16, mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36,
        hidden_size=4096, intermediate_size=12288, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
        vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960,
    )


def randomise(module: torch.nn.Module) -> None:
    """Fill every parameter of an uninitialised module: matrices N(0, 0.02), vectors (norms) 1."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0)
        for sub in module.modules():
            if isinstance(sub, Rotary):
                sub.recompute()


def build_target(device: torch.device) -> CausalLM:
    with torch.device("meta"):
        model = MODEL_CLASSES["qwen3"](target_config())
    model = model.to_empty(device=device).to(DTYPE)
    randomise(model)
    return model.eval().requires_grad_(False)


def build_drafter(device: torch.device) -> DFlashDrafter:
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_config())
    drafter = drafter.to_empty(device=device).to(DTYPE)
    randomise(drafter)
    return drafter.eval().requires_grad_(False)


def median_ms(fn: Callable[[], object], iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def as_graph(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture `fn` (warmed up on a side stream first) in a CUDA graph; return its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB."""
    src = torch.empty(1 << 30, dtype=DTYPE, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def weight_chain(model: CausalLM, tokens: int) -> tuple[float, int]:
    """(ms, bytes) of multiplying every weight matrix of `model` once by a [tokens, in] input, graph-replayed."""
    matrices = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(tokens, w.shape[1], dtype=DTYPE, device=w.device) for w in matrices]
    outputs = [torch.empty(tokens, w.shape[0], dtype=DTYPE, device=w.device) for w in matrices]

    def chain() -> None:
        for x, w, y in zip(inputs, matrices, outputs, strict=True):
            torch.mm(x, w.t(), out=y)

    ms = median_ms(as_graph(chain))
    return ms, sum(w.numel() * w.element_size() for w in matrices)


def filled_cache(capacity: int, length: int, heads: int, head_dim: int, layers: int, device: torch.device) -> KVCache:
    cache = KVCache(layers, heads, head_dim, capacity, dtype=DTYPE, device=device)
    cache.keys.normal_()
    cache.values.normal_()
    cache.positions[0, :length] = torch.arange(length, device=device)
    cache.length = length
    return cache


def target_forward(model: CausalLM, cache: KVCache, context: int, tokens: int, tree: bool) -> Callable[[], object]:
    """One forward of `tokens` new tokens after `context` committed ones (cache rewound before each call).
    With `tree`, a tree-shaped ancestor mask (a random parent before each node) instead of causal attention."""
    device = cache.keys.device
    ids = torch.randint(0, 151936, (1, tokens), device=device)
    capture = (1, 9, 17, 25, 33)
    mask = None
    positions = None
    if tree:
        visible, depth = random_tree(tokens)
        committed = torch.ones(tokens, context, dtype=torch.bool)
        mask = torch.cat((committed, visible), dim=1)[None].to(device)  # [1, tokens, context + tokens]
        positions = (context + torch.tensor(depth, device=device))[None]

    def forward() -> object:
        cache.length = context
        return model(ids, positions, cache, attn_mask=mask, capture=capture)

    return forward


def drafter_round(model: CausalLM, drafter: DFlashDrafter, cache: KVCache, context: int) -> Callable[[], object]:
    """A drafter round after `context` positions: 4 new context rows, one 16-slot block, LM head on 15 rows."""
    device = cache.keys.device
    config = drafter.config
    block = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.long, device=device)
    block_positions = torch.arange(context + 4, context + 4 + config.block_size, device=device)[None]
    new_features = torch.randn(1, 4, config.feature_size, dtype=DTYPE, device=device)
    new_positions = torch.arange(context, context + 4, device=device)[None]

    def round_() -> object:
        cache.length = context
        hidden = drafter.draft_hidden(model.embed(block), block_positions, new_features, new_positions, cache)
        return drafter.project(model, hidden[0, 1:]).argmax(-1)

    return round_


def tree_parents(tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, tokens)]


def random_tree(tokens: int) -> tuple[torch.Tensor, list[int]]:
    """A random tree of `tokens` nodes (`tree_parents`): its ancestor mask [tokens, tokens] (self included) and each
    node's depth."""
    parents = tree_parents(tokens)
    depth = [0] * tokens
    visible = torch.zeros(tokens, tokens, dtype=torch.bool)
    for node in range(tokens):
        walk = node
        while walk >= 0:
            visible[node, walk] = True
            walk = parents[walk]
        depth[node] = 0 if parents[node] < 0 else depth[parents[node]] + 1
    return visible, depth


def runner_target(runner: GraphRunner, cache: KVCache, context: int, tokens: int, tree: bool) -> Callable[[], object]:
    """`target_forward` through the runner: the tree is given as its [tokens, tokens] ancestor mask."""
    device = cache.keys.device
    ids = torch.randint(0, 151936, (1, tokens), device=device)
    tree_mask = None
    positions = None
    if tree:
        visible, depth = random_tree(tokens)
        tree_mask = visible.to(device)
        positions = (context + torch.tensor(depth, device=device))[None]

    def forward() -> object:
        cache.length = context
        out = runner.target_forward(ids, positions, cache, tree_mask, (1, 9, 17, 25, 33), "all")
        assert out is not None, "not a graph shape"
        return out

    return forward


def runner_draft(runner: GraphRunner, cache: KVCache, context: int) -> Callable[[], object]:
    """`drafter_round` through the runner: 4 new context rows, block at context + 4."""
    assert runner.drafter is not None
    config = runner.drafter.config
    new_features = torch.randn(1, 4, config.feature_size, dtype=DTYPE, device=cache.keys.device)

    def round_() -> object:
        cache.length = context
        logits = runner.draft_logits(0, context + 4, new_features, cache, config.block_size - 1)
        assert logits is not None, "not a graph shape"
        return logits.argmax(-1)

    return round_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,16384")
    parser.add_argument("--shapes", default="step_1,verify_16,tree_32,tree_64,drafter_round")
    parser.add_argument("--compile", action="store_true", help="torch.compile the target and drafter forwards first")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="the drafter scores this many (random) token ids only (`dflash.drafter.vocab`); 0: all")
    parser.add_argument("--draft-weights", choices=["dense", "int8"], default="dense",
                        help="int8: the drafter's products (and its shortlist head) as int8 rows (`dflash.drafter.int8`)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    result: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "command": "python benchmarks/gpu_scale_study.py"
        + (" --compile" if args.compile else "") + (f" --draft-vocab {args.draft_vocab}" if args.draft_vocab else "")
        + (" --draft-weights int8" if args.draft_weights == "int8" else "")
        + f" --contexts {args.contexts} --shapes {args.shapes} --out {args.out}",
        "environment": {name: value for name, value in sorted(os.environ.items()) if name.startswith("DFLASH_")},
        "weights": "random, bfloat16; target Qwen3-8B-shaped (36 layers, hidden 4096, 32/8 heads, head_dim 128, "
        "vocab 151936, untied), drafter 5 layers hidden 4096, block 16",
    }
    result["copy_bandwidth_TBps"] = round(copy_bandwidth(device) / 1e12, 3)
    print(f"copy bandwidth {result['copy_bandwidth_TBps']} TB/s", flush=True)
    model = build_target(device)
    drafter = build_drafter(device)
    if args.draft_vocab:
        shortlist = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))
        drafter.use_draft_vocab(shortlist[: args.draft_vocab].sort().values, model)
    if args.draft_weights == "int8":
        print(f"drafter: {quantize_drafter_int8(drafter)} products as int8 rows", flush=True)
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=False)  # type: ignore[method-assign]
        drafter.draft_hidden = torch.compile(drafter.draft_hidden, dynamic=False)  # type: ignore[method-assign]
    chain: dict[str, float] = {}
    for tokens in (1, 16, 64):
        ms, nbytes = weight_chain(model, tokens)
        chain[str(tokens)] = round(ms, 3)
        print(f"weight chain x{tokens}: {ms:.3f} ms ({nbytes / 1e9:.2f} GB, {nbytes / ms / 1e9:.2f} TB/s)", flush=True)
        result["weight_bytes"] = nbytes
    result["weight_chain_ms"] = chain
    per_context: dict[str, dict[str, float]] = {}
    contexts = [int(c) for c in args.contexts.split(",")]
    runner = attach_graph_runner(model, drafter, capacity=max(contexts) + 256)
    for context in contexts:
        cfg = model.config
        cache = filled_cache(context + 80, context, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, device)
        dcache = filled_cache(context + 80, context, drafter.config.num_kv_heads, drafter.config.head_dim,
                              drafter.config.num_layers, device)
        shapes = {
            "step_1": target_forward(model, cache, context, 1, tree=False),
            "verify_16": target_forward(model, cache, context, 16, tree=False),
            "tree_32": target_forward(model, cache, context, 33, tree=True),
            "tree_64": target_forward(model, cache, context, 65, tree=True),
            "drafter_round": drafter_round(model, drafter, dcache, context),
        }
        wanted = args.shapes.split(",")
        rows: dict[str, float] = {}
        with torch.inference_mode():
            for name, fn in shapes.items():
                if name not in wanted:
                    continue
                rows[f"{name}_eager_ms"] = round(median_ms(fn, iters=10, warmup=2), 3)
                rows[f"{name}_graph_ms"] = round(median_ms(as_graph(fn)), 3)
                print(f"ctx {context} {name}: eager {rows[f'{name}_eager_ms']:.3f} ms, "
                      f"graph {rows[f'{name}_graph_ms']:.3f} ms", flush=True)
            leased = runner.lease_target_cache(context + 200)
            drafter_leased = runner.lease_drafter_cache(context + 200)
            assert leased is not None and drafter_leased is not None
            for storage in (runner.target_storage, runner.drafter_storage):
                assert storage is not None
                storage.keys.normal_()
                storage.values.normal_()
                storage.positions[0, :context] = torch.arange(context, device=device)
            through_runner = {
                "step_1": runner_target(runner, leased, context, 1, tree=False),
                "verify_16": runner_target(runner, leased, context, 16, tree=False),
                "tree_32": runner_target(runner, leased, context, 33, tree=True),
                "tree_64": runner_target(runner, leased, context, 65, tree=True),
                "drafter_round": runner_draft(runner, drafter_leased, context),
            }
            for name, fn in through_runner.items():
                if name in wanted:
                    rows[f"{name}_runner_ms"] = round(median_ms(fn), 3)
                    print(f"ctx {context} {name}: runner {rows[f'{name}_runner_ms']:.3f} ms", flush=True)
            del leased, drafter_leased, through_runner
        if {"step_1", "verify_16", "drafter_round"} <= set(wanted):
            step, verify, draft = rows["step_1_runner_ms"], rows["verify_16_runner_ms"], rows["drafter_round_runner_ms"]
            rows["step_over_chain"] = round(step / chain["1"], 3)
            rows["verify16_over_step"] = round(verify / step, 3)
            rows["drafter_over_step"] = round(draft / step, 3)
        per_context[str(context)] = rows
        del cache, dcache
        torch.cuda.empty_cache()
    result["contexts"] = per_context
    projection: dict[str, dict[str, float]] = {}
    for context, rows in per_context.items():
        if "step_over_chain" not in rows:
            continue
        round_ms = rows["verify_16_runner_ms"] + rows["drafter_round_runner_ms"]
        projection[context] = {"ar_tokens_per_s": round(1e3 / rows["step_1_runner_ms"], 1)}
        for name, tau in PUBLISHED_TAU.items():
            projection[context][f"dflash_tokens_per_s_at_tau_{tau}({name})"] = round(tau * 1e3 / round_ms, 1)
    result["projection"] = {
        "label": "PROJECTION, not a measurement: tokens/s = published acceptance length / (16-token verify + "
        "drafter round, through the graph runner); AR = 1 / one-token step through the graph runner",
        "by_context": projection,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
