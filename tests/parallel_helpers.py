"""Rank programs of the tensor-parallel tests (spawned by `dflash.parallel.launch`, so they live in a module) and
the single-process references they are compared with.

The parent test builds tiny random models, saves their weights under Hugging Face names, and launches two ranks
that each load their shard, run scripted forwards and generations, and save what they saw (`rank0.pt`,
`rank1.pt`). The same scripts run in the parent on the whole model give the reference.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import tokenizers
import torch

from dflash import environment
from dflash.config import ModelConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.engine.engine import Engine, EngineOptions
from dflash.errors import DFlashError, GenerationError
from dflash.fastpath.dispatch import graph_runner_of
from dflash.fastpath.runner import MAX_GRAPH_ROWS, attach_graph_runner
from dflash.generation.request import GenerationRequest, GenerationResult
from dflash.generation.sampling import SamplingParams
from dflash.kv.cache import KVCache
from dflash.models.model import CausalLM
from dflash.models.registry import build_model
from dflash.parallel.group import TensorParallel
from dflash.parallel.sharding import shard_weights
from dflash.parallel.spmd import LeaderEngine, follow, join_engine
from dflash.tokenizer import Tokenizer

FAMILIES = ("llama", "qwen3", "gemma3")
# the sharded-forward models: the families, and Qwen3 with biases on its attention projections (the row-parallel
# output projection adds its bias once, after the sum)
FORWARD_MODELS = (*FAMILIES, "qwen3_attention_bias")
ENGINE_VOCAB = 48
DRAFTER_RAW: dict[str, Any] = {
    "num_hidden_layers": 1, "num_target_layers": 4, "hidden_size": 64, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": ENGINE_VOCAB,
    "block_size": 5, "dflash_config": {"mask_token_id": ENGINE_VOCAB - 1, "target_layer_ids": [1, 2]},
}


# ---- weights under Hugging Face names ------------------------------------------------------------------------
def hf_named(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (q/k/v and gate/up split again), as loaders produce them."""
    config = model.config
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        full = name if name.startswith("lm_head.") else f"model.{name}"
        if ".qkv_proj." in name:
            for part, piece in zip("qkv", tensor.split((q, kv, kv)), strict=True):
                out[full.replace("qkv_proj", f"{part}_proj")] = piece.clone()
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate", "up"), tensor.chunk(2), strict=True):
                out[full.replace("gate_up_proj", f"{part}_proj")] = piece.clone()
        else:
            out[full] = tensor.clone()
    return out


def word_tokenizer(vocab: int) -> Tokenizer:
    """Token i is the word `w<i>`; decoding joins words with spaces (every generation has visible text)."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    return Tokenizer(backend)


def engine_options() -> EngineOptions:
    """Small chunks and trees, a prefix cache (each rank keeps its own, of its key/value heads); eager forwards on a
    GPU too, so that one GPU runs what each rank runs; every round speculative (the one-process engine's rounds are
    compared with the ranks')."""
    return EngineOptions(
        spec="ddtree", prefill_chunk=8, ddtree_budget=6, num_drafts=3, cuda_graphs=False, prefix_cache_mb=4.0,
        always_speculate=True,
    )


# ---- scripted forwards ----------------------------------------------------------------------------------------
@torch.inference_mode()
def scripted_forwards(model: CausalLM, device: torch.device) -> dict[str, Any]:
    """Prefill (two chunks, with captured features), one decoding step, a causal 5-row verification, and a 4-node
    tree verification after cropping the verified rows away."""
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 22), generator=g).to(device)
    cache = model.new_cache(48)
    out: dict[str, Any] = {}
    first = model(ids[:, :8], cache=cache, capture=(1, 2), logits="none")
    rest = model(ids[:, 8:12], cache=cache, capture=(1, 2))
    out["features"] = torch.cat((first.features, rest.features), dim=1).cpu()
    out["prefill"] = rest.logits.cpu()
    out["step"] = model(ids[:, 12:13], cache=cache).logits.cpu()
    out["verify"] = model(ids[:, 13:18], cache=cache, capture=(2,)).logits.cpu()
    cache.crop(13)
    positions = torch.tensor([[13, 14, 14, 15]], device=device)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=device)
    out["tree"] = model(ids[:, 18:22], positions, cache, tree_mask=tree).logits.cpu()
    out["kv_heads"] = int(cache.keys.shape[2])
    return out


# ---- scripted generations -------------------------------------------------------------------------------------
class OddTokens:
    """A constraint (on the leader only): the first `count` output tokens are odd ids."""

    def __init__(self, vocab: int, count: int) -> None:
        self.vocab, self.count = vocab, count

    def start(self) -> OddState:
        return OddState(self)


class OddState:
    def __init__(self, rule: OddTokens) -> None:
        self.rule, self.written = rule, 0

    @property
    def finished(self) -> bool:
        return self.written >= self.rule.count

    def allowed(self) -> torch.Tensor:
        return torch.arange(self.rule.vocab) % 2 == 1

    def advance(self, token: int) -> bool:
        if token % 2 == 0:
            return False
        self.written += 1
        return True

    def rollback(self, count: int) -> None:
        self.written -= count


def stop_after(polls: int) -> Callable[[], bool]:
    """A `should_stop` that asks to stop from its `polls`-th call on."""
    calls = [0]

    def should_stop() -> bool:
        calls[0] += 1
        return calls[0] >= polls

    return should_stop


def generation_cases() -> list[dict[str, Any]]:
    """What the leader is asked, in order (the same list gives the single-process reference)."""
    g = torch.Generator().manual_seed(4)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, ENGINE_VOCAB - 1, (length,), generator=g).tolist()

    return [
        {"name": "plain", "prompt": prompt(19), "max": 20, "spec": "none"},
        {"name": "linear", "prompt": prompt(11), "max": 20, "spec": "linear"},
        {"name": "ddtree", "prompt": prompt(23), "max": 24, "spec": None},
        {"name": "sampled", "prompt": prompt(9), "max": 16, "spec": None, "temperature": 0.8, "seed": 11},
        {"name": "sampled_linear", "prompt": prompt(12), "max": 16, "spec": "linear", "temperature": 1.0, "seed": 3},
        {"name": "constrained", "prompt": (constrained := prompt(10)), "max": 12, "spec": None, "odd": 5,
         "cache": True},
        {"name": "unconstrained", "prompt": constrained, "max": 12, "spec": None, "cache": True},
        {"name": "cancelled", "prompt": prompt(30), "max": 40, "spec": None, "stop_after": 6},
        {"name": "refused", "prompt": [ENGINE_VOCAB + 3, 1], "max": 4, "spec": None},
        {"name": "callback_fails", "prompt": prompt(8), "max": 30, "spec": "linear", "fail_text": 2},
        {"name": "after", "prompt": prompt(14), "max": 18, "spec": None},
        {"name": "cached", "prompt": [*constrained, *prompt(9)], "max": 10, "spec": None, "cache": True},
    ]


def case_request(case: dict[str, Any]) -> GenerationRequest:
    sampling = SamplingParams(temperature=case.get("temperature", 0.0), seed=case.get("seed"))
    constraint = OddTokens(ENGINE_VOCAB, case["odd"]) if "odd" in case else None
    return GenerationRequest(
        prompt_ids=list(case["prompt"]), max_new_tokens=case["max"], sampling=sampling, constraint=constraint,
        use_prefix_cache=case.get("cache", False),
    )


def summary(outcome: GenerationResult | BaseException) -> dict[str, Any]:
    if isinstance(outcome, BaseException):
        return {"error": type(outcome).__name__, "message": str(outcome)}
    return {
        "tokens": outcome.token_ids, "finish": outcome.finish_reason, "rounds": outcome.stats.rounds,
        "accepted": outcome.stats.accepted_tokens, "cached": outcome.stats.cached_tokens,
    }


def run_cases(engine: Engine | LeaderEngine) -> dict[str, dict[str, Any]]:
    """Every case through `engine.generate`; a failure is recorded, not raised."""
    results: dict[str, dict[str, Any]] = {}
    for case in generation_cases():
        seen = [0]

        def on_text(text: str, ids: list[int], case: dict[str, Any] = case, seen: list[int] = seen) -> None:
            seen[0] += 1
            if "fail_text" in case and seen[0] >= case["fail_text"]:
                raise RuntimeError("client went away")

        stop = stop_after(case["stop_after"]) if "stop_after" in case else None
        try:
            outcome: GenerationResult | BaseException = engine.generate(
                case_request(case), on_text=on_text, should_stop=stop, spec=case["spec"]
            )
        except (DFlashError, RuntimeError) as exc:
            outcome = exc
        results[case["name"]] = summary(outcome)
    return results


# ---- models of the runs ---------------------------------------------------------------------------------------
def load_drafter(saved: dict[str, Any], device: torch.device) -> DFlashDrafter:
    drafter = DFlashDrafter(DrafterConfig.from_dict(DRAFTER_RAW))
    drafter.load_state_dict(saved)
    return drafter.to(device).eval().requires_grad_(False)


def whole_target(saved: dict[str, Any], device: torch.device) -> CausalLM:
    return build_model(saved["config"], saved["weights"], device=device)


# ---- the rank program -----------------------------------------------------------------------------------------
def rank_program(tp: TensorParallel, payload: dict[str, Any]) -> int:
    """payload["part"] "forwards": scripted forwards of each family's shard; "engine": the scripted generations
    (leader) or the follower loop. Saves what this rank saw to `<part>_rank<r>.pt`."""
    folder = Path(payload["folder"])
    if payload["part"] == "sums":
        torch.save(sums_program(tp), folder / f"sums_rank{tp.rank}.pt")
        return 0
    saved = torch.load(folder / "models.pt", weights_only=False)
    record: dict[str, Any] = {}
    if payload["part"] == "forwards":
        for family in FORWARD_MODELS:
            for split in ("0", "1"):  # the embeddings and LM head replicated, then split by vocabulary rows
                os.environ[environment.TP_VOCAB_SPLIT] = split
                config: ModelConfig = saved[family]["config"]
                shard = shard_weights(saved[family]["weights"], config, tp.rank, tp.world)
                model = build_model(config, shard, device=tp.device, tensor_parallel=tp)
                name = family + ("_vocab_split" if split == "1" else "")
                record[name] = scripted_forwards(model, tp.device)
                record[name]["head_rows"] = int(model.lm_head.weight.shape[0])
        os.environ.pop(environment.TP_VOCAB_SPLIT)
    else:
        record = engine_program(tp, saved["engine"], graphed=payload["part"] == "graphed")
    torch.save(record, folder / f"{payload['part']}_rank{tp.rank}.pt")
    return 0


def graphed_engine(target: CausalLM, drafter: DFlashDrafter) -> Engine:
    """An engine whose forwards go through a graph runner: captured CUDA graphs on a GPU (all-reduces inside), the
    same static forwards run eagerly on the CPU."""
    if target.embed_tokens.weight.is_cuda:
        return Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, replace(engine_options(), cuda_graphs=True))
    engine = Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, engine_options())
    attach_graph_runner(target, drafter, capacity=engine.max_ctx + 2 * MAX_GRAPH_ROWS + 8, capture=False)
    return engine


def engine_program(tp: TensorParallel, pair: dict[str, Any], *, graphed: bool = False) -> dict[str, Any]:
    config = pair["config"]
    target = build_model(
        config, shard_weights(pair["weights"], config, tp.rank, tp.world), device=tp.device, tensor_parallel=tp
    )
    drafter = load_drafter(pair["drafter"], tp.device)
    if graphed:
        engine = graphed_engine(target, drafter)
    else:
        engine = Engine(target, word_tokenizer(ENGINE_VOCAB), drafter, engine_options())
    agreement = join_engine(engine, tp)
    record: dict[str, Any] = {"all_reduce": tp.sums.mode}
    if tp.leader:
        leader = LeaderEngine(engine, agreement)
        runner = graph_runner_of(target)
        if graphed:
            record["warm_up_served"] = leader.warm_up()
            if runner is not None:
                # the leader alone still holds a view of the runner's cache (as a lingering traceback could): every
                # rank must then run this generation eagerly, or their collectives fall out of step. (Leasing is a
                # collective itself, so the view is made and recorded here directly.)
                held = KVCache.view_of(runner.target_storage, 64)
                runner._leases["target"] = weakref.ref(held)
                record["held_lease"] = summary(leader.generate(case_request(generation_cases()[0]), spec="none"))
                record["served_while_held"] = runner.served - record["warm_up_served"]
                del held
        record["generations"] = run_cases(leader)
        record["served"] = runner.served if runner is not None else 0
        leader.close()
        try:
            leader.generate(case_request(generation_cases()[0]))
        except GenerationError as exc:
            record["after_close"] = str(exc)
    else:
        followed: list[dict[str, Any]] = []
        record["handed_out"] = follow(engine, agreement, on_result=lambda outcome: followed.append(summary(outcome)))
        record["generations"] = followed
    return record


def sums_program(tp: TensorParallel) -> dict[str, Any]:
    """The folded rank sums (`PartialSums.add_rms_norm` in "fused" and "oneway" modes) against NCCL's all-reduce
    followed by the add+RMSNorm, on bf16 rows of a width that is no power of two: eagerly, 40 times in a row (with a
    one-shot all-reduce in between), and as a chain of four replayed 20 times from a CUDA graph. Consecutive folded
    sums alternate between the two regions, as the fused forward's do."""
    from dflash.kernels.triton_decode import add_rms_norm

    sums, device, width, eps = tp.sums, tp.device, 1000, 1e-6
    record: dict[str, Any] = {"mode": sums.prepare(width, torch.bfloat16), "cases": {}}
    calls = itertools.count()

    def folded(partial: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return sums.add_rms_norm(partial, residual, weight, eps, next(calls) % 2)

    for mode in ("fused", "oneway"):
        for rows in (1, 3, 33, 128):
            generator = torch.Generator().manual_seed(rows)
            residual, weight = (torch.randn(rows, width, generator=generator).to(device, torch.bfloat16),
                                torch.randn(width, generator=generator).to(device, torch.bfloat16))
            partials = [torch.randn(4, rows, width, generator=generator) for _ in range(tp.world)]
            mine = partials[tp.rank].to(device, torch.bfloat16)  # [4, rows, width]: four sub-layers' partial rows
            sums.use("nccl")
            plain = [sums(mine[step].clone()) for step in range(4)]
            expected, stream = [], residual
            for step in range(4):
                normed, stream = add_rms_norm(sums(mine[step].clone()), stream, weight, eps)
                expected.append((normed, stream))
            sums.use(mode)
            eager = [folded(mine[i % 4], None if i % 4 else residual) for i in range(40)]
            one_shot = sums(mine[0].clone())  # the one-shot all-reduce between folded sums uses its own buffer
            first = folded(mine[0], residual)
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # the kernel compiled before capture
                folded(mine[0], residual)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                chain, stream = [], residual
                for step in range(4):
                    normed, stream = folded(mine[step], stream)
                    chain.append((normed, stream))
            replays = []
            for _ in range(20):
                graph.replay()
                replays.append([(a.clone(), b.clone()) for a, b in chain])
            torch.cuda.synchronize()
            record["cases"][(mode, rows)] = {
                "expected": [(a.cpu(), b.cpu()) for a, b in expected],
                "plain": [t.cpu() for t in plain],
                "first": tuple(t.cpu() for t in first),
                "one_shot": one_shot.cpu(),
                "eager_repeats_equal": all(
                    torch.equal(eager[i][0], eager[i % 4][0]) and torch.equal(eager[i][1], eager[i % 4][1])
                    for i in range(40)
                ),
                "eager_plain_sum": eager[1][1].cpu(),  # no residual: the plain sum of the second partial rows
                "replays": [[(a.cpu(), b.cpu()) for a, b in replay] for replay in replays],
            }
            del graph
    return record
