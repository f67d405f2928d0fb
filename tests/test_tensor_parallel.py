"""Tensor parallelism on two ranks equals one process: sharded forwards, and generations driven by the leader.

Two ranks are spawned by `dflash.parallel.launch` (gloo on the CPU; NCCL on two GPUs for the `gpu` variant), load
their shards of tiny random Llama, Qwen3 and Gemma 3 targets, and compare with the whole model in float32:
logits and captured features of prefill, decoding step, verification and tree verification; then greedy
generations through the engine in plain, linear and DDTree modes, plus sampling, a constraint applied by the
leader alone, a cancellation, a refused request and a failing stream callback, after which the ranks must still be
in step.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.config import ModelConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.engine.engine import Engine
from dflash.errors import ModelLoadError
from dflash.models.resolve import load_checkpoint
from dflash.parallel.launch import launch
from dflash.parallel.sharding import shard_config, shard_span, shard_weights
from tests.parallel_helpers import (
    DRAFTER_RAW,
    ENGINE_VOCAB,
    FAMILIES,
    FORWARD_MODELS,
    engine_options,
    hf_named,
    load_drafter,
    rank_program,
    run_cases,
    scripted_forwards,
    whole_target,
    word_tokenizer,
)
from tests.spec_helpers import tiny_random_pair
from tests.tiny_models import hf_tiny, ours_from_hf

WORLD = 2
TIMEOUT = timedelta(seconds=90)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two CUDA devices"),
        ],
    ),
]


def _saved_models(folder: Path) -> dict[str, Any]:
    saved: dict[str, Any] = {}
    for family in FAMILIES:
        model = ours_from_hf(hf_tiny(family))
        saved[family] = {"config": model.config, "weights": hf_named(model)}
    biased = ours_from_hf(hf_tiny("qwen3", attention_bias=True))
    saved["qwen3_attention_bias"] = {"config": biased.config, "weights": hf_named(biased)}
    # embeddings scaled by 0.3: the tied target often repeats its last token and the drafter, which reads the
    # target's embeddings and LM head, often guesses so (drafts get accepted); sampling gives varied tokens
    target, _ = tiny_random_pair(ENGINE_VOCAB, 0.3, block=DRAFTER_RAW["block_size"])
    torch.manual_seed(7)
    drafter = DFlashDrafter(DrafterConfig.from_dict(DRAFTER_RAW))  # reads two target layers, unlike the pair's
    saved["engine"] = {"config": target.config, "weights": hf_named(target), "drafter": drafter.state_dict()}
    torch.save(saved, folder / "models.pt")
    return saved


@pytest.fixture(scope="module", params=DEVICES)
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny models, saved for the ranks, and the device type the runs use."""
    device_type: str = request.param
    folder = tmp_path_factory.mktemp(f"tp_{device_type}")
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    return {"folder": folder, "saved": _saved_models(folder), "device_type": device_type, "device": device}


def _launch(models: dict[str, Any], part: str) -> list[dict[str, Any]]:
    """Two ranks run `part` of `parallel_helpers.rank_program`; what each saw. A hung collective fails the run
    after TIMEOUT instead of holding the test forever."""
    folder = models["folder"]
    code = launch(WORLD, rank_program, {"folder": str(folder), "part": part}, device_type=models["device_type"],
                  timeout=TIMEOUT)
    assert code == 0
    return [torch.load(folder / f"{part}_rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def forwards(models: dict[str, Any]) -> dict[str, Any]:
    ranks = _launch(models, "forwards")
    whole = {family: scripted_forwards(whole_target(models["saved"][family], models["device"]), models["device"])
             for family in FORWARD_MODELS}
    return {"ranks": ranks, "whole": whole}


@pytest.fixture(scope="module")
def generations(models: dict[str, Any]) -> dict[str, Any]:
    ranks = _launch(models, "engine")
    pair, device = models["saved"]["engine"], models["device"]
    engine = Engine(
        whole_target(pair, device), word_tokenizer(ENGINE_VOCAB), load_drafter(pair["drafter"], device),
        engine_options(),
    )
    return {"ranks": ranks, "whole": run_cases(engine)}


@pytest.fixture(scope="module")
def graphed_generations(models: dict[str, Any], generations: dict[str, Any]) -> dict[str, Any]:
    """The same cases with every rank's forwards through a graph runner (captured graphs on GPUs)."""
    return {"ranks": _launch(models, "graphed"), "whole": generations["whole"]}


@pytest.mark.parametrize("split", ["", "_vocab_split"])
@pytest.mark.parametrize("family", FORWARD_MODELS)
def test_sharded_forwards_equal_the_whole_model(
    models: dict[str, Any], forwards: dict[str, Any], family: str, split: str
) -> None:
    whole = forwards["whole"][family]
    config: ModelConfig = models["saved"][family]["config"]
    vocab = config.vocab_size
    for rank in forwards["ranks"]:
        mine = rank[family + split]
        assert mine["head_rows"] == (vocab // WORLD if split else vocab)
        assert mine["kv_heads"] == config.num_kv_heads // WORLD  # each rank caches only its key/value heads
        for key in ("prefill", "step", "verify", "tree", "features"):
            assert mine[key].shape == whole[key].shape
            torch.testing.assert_close(mine[key], whole[key], rtol=1e-5, atol=1e-5, msg=f"{family} {key}")
    # the all-reduced residual stream is the same on both ranks, bit for bit
    for key in ("prefill", "step", "verify", "tree", "features"):
        assert torch.equal(forwards["ranks"][0][family + split][key], forwards["ranks"][1][family + split][key])


def test_greedy_generations_equal_one_process(generations: dict[str, Any]) -> None:
    whole = generations["whole"]
    leader = generations["ranks"][0]["generations"]
    for name in ("plain", "linear", "ddtree", "constrained", "unconstrained", "after", "cached"):
        assert leader[name] == whole[name], name
        assert len(leader[name]["tokens"]) > 0
    assert leader["ddtree"]["rounds"] > 0 and leader["linear"]["rounds"] > 0
    assert leader["ddtree"]["accepted"] > 0  # rounds that kept drafted rows (the cache compacted or cropped past them)
    # the constraint lived on the leader alone and still held: the first 5 tokens are odd (the model alone would
    # write even ones there)
    assert all(t % 2 == 1 for t in leader["constrained"]["tokens"][:5])
    assert leader["unconstrained"]["tokens"][0] % 2 == 0
    # prompts that share a prefix restore it from each rank's prefix cache (its own key/value heads)
    assert leader["unconstrained"]["cached"] == 8 and leader["cached"]["cached"] == 8


def test_sampling_and_cancellation_follow_the_leader(generations: dict[str, Any]) -> None:
    whole = generations["whole"]
    leader = generations["ranks"][0]["generations"]
    for name in ("sampled", "sampled_linear"):
        assert leader[name] == whole[name], name  # the leader's generator, seeded as in one process
        assert len(set(leader[name]["tokens"])) > 4
    assert leader["cancelled"]["finish"] == "cancelled" == whole["cancelled"]["finish"]
    assert leader["cancelled"]["tokens"] == whole["cancelled"]["tokens"]
    assert 0 < len(leader["cancelled"]["tokens"]) < 40
    assert leader["refused"]["error"] == "GenerationError" == whole["refused"]["error"]
    assert leader["callback_fails"] == {"error": "RuntimeError", "message": "client went away"}


def test_followers_run_every_handed_out_generation_in_step(generations: dict[str, Any]) -> None:
    leader = generations["ranks"][0]["generations"]
    follower = generations["ranks"][1]
    handed = [name for name in leader if name != "refused"]  # a refused request never leaves the leader
    assert follower["handed_out"] == len(handed)
    by_name = dict(zip(handed, follower["generations"], strict=True))
    for name in handed:
        if name == "callback_fails":  # the leader's callback failed: every rank ended the generation there
            assert by_name[name]["finish"] == "cancelled"
            assert 0 < len(by_name[name]["tokens"]) < 30
            continue
        assert by_name[name] == leader[name], name
    assert "shut down" in generations["ranks"][0]["after_close"]


def test_graphed_forwards_under_tensor_parallelism_give_the_same_generations(
    models: dict[str, Any], graphed_generations: dict[str, Any]
) -> None:
    whole = graphed_generations["whole"]
    leader, follower = graphed_generations["ranks"]
    assert leader["served"] > 20  # the rounds really went through the runner's static forwards (graphs on GPUs)
    if models["device_type"] == "cuda":
        assert leader["warm_up_served"] > 0  # the warm-up generation, handed out, captured graphs on both ranks
    else:
        assert leader["all_reduce"] == follower["all_reduce"] == "nccl"  # gloo's all_reduce on CPU ranks
    assert leader["all_reduce"] == follower["all_reduce"]
    generated = leader["generations"]
    for name in ("plain", "linear", "ddtree", "constrained", "unconstrained", "after", "cached"):
        assert generated[name] == whole[name], name
    assert generated["ddtree"]["accepted"] > 0 and generated["linear"]["rounds"] > 0
    assert generated["cancelled"]["finish"] == "cancelled"
    assert generated["callback_fails"] == {"error": "RuntimeError", "message": "client went away"}
    assert follower["generations"][-1] == generated["cached"]  # still in step after the failures
    # a generation while the leader alone could not lease the runner's cache ran eagerly on every rank, in step
    assert leader["held_lease"] == whole["plain"] and leader["served_while_held"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs two CUDA devices")
def test_folded_rank_sums_equal_the_all_reduce_then_the_add_norm(tmp_path: Path) -> None:
    """One kernel that sums the ranks' rows over symmetric memory and does the add+RMSNorm (with flags, "fused",
    or rows that carry their own arrival, "oneway") gives the bits of NCCL's all-reduce followed by the
    add+RMSNorm, on every rank, eagerly and replayed from a graph."""
    assert launch(WORLD, rank_program, {"folder": str(tmp_path), "part": "sums"}, device_type="cuda",
                  timeout=TIMEOUT) == 0
    ranks = [torch.load(tmp_path / f"sums_rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert [rank["mode"] for rank in ranks] == ["oneway", "oneway"]  # auto's choice where both GPUs reach each other
    assert {mode for mode, _ in ranks[0]["cases"]} == {"fused", "oneway"}
    for rows, case in ranks[0]["cases"].items():
        expected = case["expected"]
        assert torch.equal(case["first"][0], expected[0][0]) and torch.equal(case["first"][1], expected[0][1]), rows
        assert case["eager_repeats_equal"], rows
        assert torch.equal(case["one_shot"], case["plain"][0]), rows
        assert torch.equal(case["eager_plain_sum"], case["plain"][1]), rows
        for replay in case["replays"]:
            for (normed, stream), (want_normed, want_stream) in zip(replay, expected, strict=True):
                assert torch.equal(normed, want_normed) and torch.equal(stream, want_stream), rows
        other = ranks[1]["cases"][rows]
        assert torch.equal(case["eager_plain_sum"], other["eager_plain_sum"])
        assert torch.equal(case["one_shot"], other["one_shot"])
        assert all(torch.equal(a, b) for a, b in zip(case["first"], other["first"], strict=True))


def test_shard_config_refuses_uneven_splits() -> None:
    config = ours_from_hf(hf_tiny("qwen3")).config  # 4 heads, 2 key/value heads, MLP 128
    assert shard_config(config, 2).num_kv_heads == 1
    with pytest.raises(ModelLoadError, match="2 key/value heads do not split evenly"):
        shard_config(config, 4)


def test_shard_spans_cover_each_split_tensor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_TP_VOCAB_SPLIT", raising=False)  # the default: split
    model = ours_from_hf(hf_tiny("qwen3"))
    weights = hf_named(model)
    config = model.config
    parts = [shard_weights(weights, config, rank, WORLD) for rank in range(WORLD)]
    for name, tensor in weights.items():
        span = shard_span(name, config, 0, WORLD)
        if span is None:
            assert all(torch.equal(p[name], tensor) for p in parts), name  # replicated
            continue
        dim = span[0]
        assert torch.equal(torch.cat([p[name] for p in parts], dim=dim), tensor), name
    assert shard_span("model.layers.0.self_attn.o_proj.weight", config, 1, WORLD) == (1, 32, 32)
    assert shard_span("model.layers.3.mlp.gate_proj.weight", config, 1, WORLD) == (0, 64, 64)
    # the vocabulary's rows are split where they divide evenly (512 ids: 256 per rank), replicated otherwise
    assert shard_span("model.embed_tokens.weight", config, 1, WORLD) == (0, 256, 256)
    assert shard_span("model.norm.weight", config, 1, WORLD) is None
    odd = replace(config, vocab_size=513)
    assert shard_span("model.embed_tokens.weight", odd, 1, WORLD) is None
    assert shard_config(odd, WORLD).vocab_size == 513 and shard_config(config, WORLD).vocab_size == 256
    monkeypatch.setenv("DFLASH_TP_VOCAB_SPLIT", "0")  # replicated
    assert shard_span("model.embed_tokens.weight", config, 1, WORLD) is None
    assert shard_config(config, WORLD).vocab_size == 512


def test_a_rank_reads_only_its_part_of_a_hugging_face_folder(tmp_path: Path) -> None:
    hf = hf_tiny("qwen3")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    whole = load_checkpoint(tmp_path)
    for rank in range(WORLD):
        part = load_checkpoint(tmp_path, torch.bfloat16, shard=(rank, WORLD))
        assert part.config == whole.config  # the config still describes the whole model
        expected = shard_weights(whole.weights, whole.config, rank, WORLD)
        assert part.weights.keys() == expected.keys()
        for name, tensor in expected.items():
            assert part.weights[name].dtype == torch.bfloat16
            assert torch.equal(part.weights[name], tensor.to(torch.bfloat16)), name
    with pytest.raises(ModelLoadError, match="dense weights"):
        load_checkpoint(tmp_path, shard=(0, WORLD), weights="quantized")
