"""Scale study of the newer families on one GPU: a Qwen3.5-27B-shaped hybrid and a Qwen3-30B-A3B-shaped mixture of
experts, random bf16 weights at the published shapes.

For each model, in one run and on the same device:
* copy bandwidth (device to device, bytes read + written per second) and the weight bytes one token reads (every
  matrix for the hybrid; for the mixture the attention, routers, LM head and the 8 chosen experts of each layer),
  hence the weight-streaming floor of a one-token step (bytes / copy bandwidth);
* our forward of 1 token (a decoding step) and of 16 (a linear verification) after `--context` cached positions,
  eager, replayed from a graph of the whole forward where it can be captured (`*_graph_ms`, else
  `*_graph_error`), and what the engine runs where it captures the model (`*_engine_ms`: its graph runner, with
  the fused layers where the model takes them; the mixture on a GPU), and a 32-node tree verification for the
  mixture (the hybrid verifies linearly);
* for the hybrid, the rollback of a rejected draft: cropping the linear-attention state back into the last
  16-row forward (the kept rows replayed from the state before it) after 1 and after 8 accepted rows;
* verification over step, and the break-even acceptance it implies: a speculative round pays when its committed
  tokens exceed (verify + rollback) / step, drafter excluded;
* for the hybrid, a PROJECTION (labelled so in the file) from the acceptance lengths Lucebox published for
  Qwen3.5-27B with DDTree budget 22: tokens/s <= acceptance / (16-row verify + rollback keeping 8 rows), an upper
  bound (a 22-node tree costs more than 16 rows, the drafter round is left out). No published acceptance for a
  Qwen3-30B-A3B drafter was at hand.

Usage: python benchmarks/gpu_family_scale_study.py --out results/gpu_family_scale_study_h100.json
       python benchmarks/gpu_family_scale_study.py --project-into results/gpu_family_scale_study_h200.json  # no GPU
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_scale_study import (  # benchmarks/ is on the path
    DTYPE,
    as_graph,
    copy_bandwidth,
    median_ms,
    random_tree,
    randomise,
)

from dflash.bench.provenance import provenance
from dflash.config import ModelConfig
from dflash.fastpath.runner import MAX_GRAPH_ROWS, GraphRunner
from dflash.kv.cache import KVCache
from dflash.kv.static_recurrent import StaticRecurrentStates
from dflash.models.model import CausalLM
from dflash.models.registry import MODEL_CLASSES

# transformers' names and the published sizes (Qwen3.5-27B: 3 Gated DeltaNet layers to 1 gated attention layer)
QWEN3_5_27B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, partial_rotary_factor=0.25,
    rope_theta=10_000_000.0, max_position_embeddings=262144, tie_word_embeddings=False,
)
QWEN3_30B_A3B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False, norm_topk_prob=True,
)


def model_configs(layers: int | None = None) -> dict[str, ModelConfig]:
    """The published shapes; `layers`: that many layers instead (a model too big for the GPU, same layer mix)."""
    import transformers

    depth = {} if layers is None else {"num_hidden_layers": layers}
    return {
        "qwen3.5-27b": ModelConfig.from_hf(transformers.Qwen3_5TextConfig(**{**QWEN3_5_27B, **depth}).to_dict()),
        "qwen3-30b-a3b": ModelConfig.from_hf(transformers.Qwen3MoeConfig(**{**QWEN3_30B_A3B, **depth}).to_dict()),
    }


def build(config: ModelConfig, device: torch.device) -> CausalLM:
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    model = model.to(DTYPE).to_empty(device=device)  # made in bf16 directly (float32 first would not fit 80 GB)
    randomise(model)
    return model.eval().requires_grad_(False)


def token_bytes(model: CausalLM) -> int:
    """Weight bytes one token reads: every parameter except the embedding table (one row of it) and the experts
    not chosen (each layer's mixture reads its top-k experts of the total)."""
    config = model.config
    total = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name.startswith("embed_tokens"):
            size = param.shape[-1] * param.element_size()
        elif param.dim() == 3 and config.is_moe:  # stacked experts [experts, out, in]
            size = size * config.num_experts_per_tok // config.num_experts
        total += size
    return total


def filled_cache(model: CausalLM, capacity: int, context: int) -> KVCache:
    """A cache that has absorbed `context` positions (random keys and values; for the hybrid, random states)."""
    cache = model.new_cache(capacity)
    cache.keys.normal_()
    cache.values.normal_()
    cache.positions[0, :context] = torch.arange(context, device=cache.keys.device)
    cache.length = context
    if cache.recurrent is not None:
        for state in cache.recurrent.states:
            state.normal_(0.0, 0.02)
        cache.recurrent.length = context
    return cache


def forward(model: CausalLM, cache: KVCache, context: int, tokens: int, tree: bool) -> Callable[[], object]:
    """`tokens` new rows after `context` cached positions, the cache (and any recurrent state) rewound first."""
    device = cache.keys.device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    positions, mask = None, None
    if tree:
        visible, depth = random_tree(tokens)
        committed = torch.ones(tokens, context, dtype=torch.bool)
        mask = torch.cat((committed, visible), dim=1)[None].to(device)  # [1, tokens, context + tokens]
        positions = (context + torch.tensor(depth, device=device))[None]
    recurrent = cache.recurrent
    snapshot = recurrent.snapshot() if recurrent is not None else None

    def run() -> object:
        cache.length = context
        if recurrent is not None and snapshot is not None:
            recurrent.restore(snapshot, context)
        return model(ids, positions, cache, attn_mask=mask)

    return run


def engine_forward(runner: GraphRunner, context: int, tokens: int, tree: bool) -> Callable[[], object]:
    """The engine's forward of `tokens` rows (`GraphRunner.target_forward`: the fused layers where the model takes
    them, graphs captured on first use) over the runner's cache rewound to `context` random positions."""
    cache = runner.lease_target_cache(context + MAX_GRAPH_ROWS)
    assert cache is not None
    device = runner.device
    ids = torch.randint(0, runner.target.config.vocab_size, (1, tokens), device=device)
    tree_mask, positions = None, None
    if tree:
        visible, depth = random_tree(tokens)
        tree_mask = visible.to(device)
        positions = (context + torch.tensor(depth, device=device))[None]

    recurrent = cache.recurrent
    if recurrent is not None:  # a hybrid: its fixed state buffers hold random states of `context` positions
        assert isinstance(recurrent, StaticRecurrentStates)
        recurrent.committed_states.normal_(0.0, 0.02)
        recurrent.length = context

    def run() -> object:
        cache.length = context
        if recurrent is not None and recurrent.length != context:
            recurrent.crop(context)  # back into the last forward: nothing replayed, the committed state stays
        out = runner.target_forward(ids, positions, cache, tree_mask, (), "all")
        assert out is not None, "not a graph shape"
        return out

    return run


def crop_ms(run: Callable[[], object], crop: Callable[[], None], after: Callable[[], None] = lambda: None) -> float:
    """Device ms of `crop` after each `run` (median of 20 after 5 warm ones); `after` runs untimed after each."""
    times = []
    for _ in range(25):
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        crop()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        after()
    return sorted(times[5:])[len(times[5:]) // 2]


def engine_rollback(runner: GraphRunner, context: int, rows: int, kept: int) -> float:
    """Device ms of cropping the runner's hybrid state back to `kept` of a `rows`-row graphed forward: the kept rows
    replayed into every layer's committed state at once (`dflash.kv.static_recurrent`)."""
    run = engine_forward(runner, context, rows, tree=False)
    recurrent = runner.target_storage.recurrent
    assert isinstance(recurrent, StaticRecurrentStates)

    def start_again() -> None:  # the replay committed: the next forward starts from random states at `context`
        recurrent.reset()
        recurrent.committed_states.normal_(0.0, 0.02)
        recurrent.length = context

    return crop_ms(run, lambda: recurrent.crop(context + kept), start_again)


def rollback(model: CausalLM, cache: KVCache, context: int, rows: int, kept: int) -> float:
    """Device ms of cropping the state back to `kept` of the last forward's `rows` rows."""
    assert cache.recurrent is not None
    return crop_ms(forward(model, cache, context, rows, tree=False), lambda: cache.crop(context + kept))


def prefill_ms(model: CausalLM, lengths: list[int]) -> dict[str, dict[str, float]]:
    """Eager forwards of a prompt chunk of each length from an empty cache, with the linear-attention layers'
    prompt rule through flash-linear-attention's kernels and through the torch form (`DFLASH_FLA=0`)."""
    out: dict[str, dict[str, float]] = {}
    for tokens in lengths:
        cache = model.new_cache(tokens + 64)
        run = forward(model, cache, 0, tokens, tree=False)
        row = {}
        for label, value in (("fla_ms", "1"), ("torch_ms", "0")):
            os.environ["DFLASH_FLA"] = value
            row[label] = round(median_ms(run, iters=3), 2)
        os.environ.pop("DFLASH_FLA")
        row["speedup"] = round(row["torch_ms"] / row["fla_ms"], 2)
        out[str(tokens)] = row
        del cache
    return out


def study(
    name: str, config: ModelConfig, context: int, bandwidth: float, device: torch.device,
    prefill: list[int] | None = None, prefill_only: bool = False,
) -> dict[str, Any]:
    model = build(config, device)
    cache = filled_cache(model, context + 64, context)
    weights = token_bytes(model)
    out: dict[str, Any] = {
        "layers": config.num_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
        "token_weight_gb": round(weights / 1e9, 3), "floor_step_ms": round(weights / bandwidth * 1e3, 3),
        "gpu_memory_gib": round(torch.cuda.memory_allocated(device) / 2**30, 2),
    }
    if prefill and config.is_hybrid:
        with torch.inference_mode():
            out["prefill"] = prefill_ms(model, prefill)
        print(name, json.dumps(out["prefill"]), flush=True)
    if prefill_only:
        del model, cache
        torch.cuda.empty_cache()
        return out
    shapes = {"step_1": (1, False), "verify_16": (16, False)}
    if cache.recurrent is None:
        shapes["tree_32"] = (32, True)
    with torch.inference_mode():
        for shape, (tokens, tree) in shapes.items():
            run = forward(model, cache, context, tokens, tree)
            out[f"{shape}_eager_ms"] = round(median_ms(run, iters=10), 3)
            try:  # what a captured forward would take, where the forward can be captured at all
                out[f"{shape}_graph_ms"] = round(median_ms(as_graph(run), iters=10), 3)
            except Exception as exc:  # recorded, not fatal: the eager figures stand
                out[f"{shape}_graph_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        if cache.recurrent is not None:  # the torch rule the engine ran before the program, for comparison
            os.environ["DFLASH_DELTA_RULE_PROGRAM"] = "0"
            for shape, (tokens, tree) in shapes.items():
                run = forward(model, cache, context, tokens, tree)
                out[f"{shape}_eager_torch_rule_ms"] = round(median_ms(run, iters=5), 3)
            out["rollback_16_keep8_torch_rule_ms"] = round(rollback(model, cache, context, 16, 8), 3)
            os.environ.pop("DFLASH_DELTA_RULE_PROGRAM")
        # what the engine runs: its graph runner (fused layers where the model takes them; a hybrid's unfused
        # static forwards beside them, `_unfused`)
        for fused in ((None, False) if config.is_hybrid else (None,)) if model.capturable else ():
            runner = GraphRunner(model, None, context + 2 * MAX_GRAPH_ROWS, fused=fused)
            runner.target_storage.keys.normal_()
            runner.target_storage.values.normal_()
            runner.target_storage.positions[0, :context] = torch.arange(context, device=device)
            suffix = "" if fused is None else "_unfused"
            out[f"engine{suffix}_fused"] = runner.fused
            engine_shapes = {**shapes, "tree_32": (32, True)}  # hybrids verify trees in the runner too
            for shape, (tokens, tree) in engine_shapes.items():  # each forward's cache lease ends with its timing
                timed = median_ms(engine_forward(runner, context, tokens, tree), iters=10)
                out[f"{shape}_engine{suffix}_ms"] = round(timed, 3)
            if runner.hybrid:
                for kept in (1, 8):
                    rolled = engine_rollback(runner, context, 16, kept)
                    out[f"engine{suffix}_rollback_16_keep{kept}_ms"] = round(rolled, 3)
            del runner
        if cache.recurrent is not None:
            for kept in (1, 8):
                out[f"rollback_16_keep{kept}_ms"] = round(rollback(model, cache, context, 16, kept), 3)
    step = out["step_1_eager_ms"]
    out["step_over_floor"] = round(step / out["floor_step_ms"], 2)
    out["verify16_over_step"] = round(out["verify_16_eager_ms"] / step, 2)
    rollback_ms = out.get("rollback_16_keep8_ms", 0.0)
    out["break_even_acceptance_verify16"] = round((out["verify_16_eager_ms"] + rollback_ms) / step, 2)
    if "tree_32_eager_ms" in out:
        out["tree32_over_step"] = round(out["tree_32_eager_ms"] / step, 2)
    print(name, json.dumps(out), flush=True)
    del model, cache
    torch.cuda.empty_cache()
    return out
# acceptance lengths Lucebox published for Qwen3.5-27B (Q4_K_M, DDTree budget 22, 256 new tokens), projection only
PUBLISHED_HYBRID_TAU = {"HumanEval": 8.31, "Math500": 7.04, "GSM8K": 6.14}


def hybrid_projection(row: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s from published acceptance over the measured graphed costs of the hybrid (see the module doc): the
    engine's 32-node tree verification where measured (more rows than budget 22's 23), else the 16-row one."""
    step = row.get("step_1_engine_ms", row["step_1_graph_ms"])
    rollback_ms = row.get("engine_rollback_16_keep8_ms", row["rollback_16_keep8_ms"])
    verify_key = "tree_32_engine_ms" if "tree_32_engine_ms" in row else "verify_16_engine_ms"
    verify_ms = row.get(verify_key, row["verify_16_graph_ms"])
    round_ms = verify_ms + rollback_ms
    projected = {"ar_tokens_per_s": round(1e3 / step, 1), "round_ms": round(round_ms, 3), "verification": verify_key}
    for name, tau in PUBLISHED_HYBRID_TAU.items():
        projected[f"dflash_tokens_per_s_at_tau_{tau}({name})"] = round(tau * 1e3 / round_ms, 1)
        projected[f"speedup_at_tau_{tau}({name})"] = round(tau * step / round_ms, 2)
    return {
        "label": "PROJECTION, not a measurement: tokens/s <= published acceptance length (Lucebox, Qwen3.5-27B "
        "Q4_K_M, DDTree budget 22) / (the engine's graphed 32-node tree verification, or 16-row one where no tree "
        "was timed, + the rollback keeping 8 rows); an upper bound: the drafter round is left out, and the "
        "published acceptance is Lucebox's drafter on the real model. AR = 1 / the graphed one-token step",
        "qwen3.5-27b": projected,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3.5-27b,qwen3-30b-a3b")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None, help="layers instead of the published count")
    parser.add_argument("--prefill", default="", help="comma list of prompt chunk lengths to time (hybrids)")
    parser.add_argument("--prefill-only", action="store_true", help="only the --prefill timings")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--project-into", type=Path, default=None,
                        help="add the hybrid's projection to an earlier result file and exit (no GPU)")
    args = parser.parse_args()
    if args.project_into is not None:
        earlier = json.loads(args.project_into.read_text())
        earlier["projection"] = hybrid_projection(earlier["models"]["qwen3.5-27b"])
        args.project_into.write_text(json.dumps(earlier, indent=1) + "\n")
        print(json.dumps(earlier["projection"], indent=1))
        return
    prefill = [int(n) for n in args.prefill.split(",") if n]
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    configs = model_configs(args.layers)
    result: dict[str, Any] = {
        **provenance(device), "context": args.context, "layers": args.layers, "copy_bandwidth_gbps": round(bandwidth / 1e9, 1),
        "shapes": {name: (QWEN3_5_27B if name == "qwen3.5-27b" else QWEN3_30B_A3B) for name in args.models.split(",")},
        "models": {},
    }
    for name in args.models.split(","):
        result["models"][name] = study(name, configs[name], args.context, bandwidth, device, prefill, args.prefill_only)
    if "qwen3.5-27b" in result["models"] and not args.prefill_only:
        result["projection"] = hybrid_projection(result["models"]["qwen3.5-27b"])
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
