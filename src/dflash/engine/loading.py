"""Build an `Engine` from user-facing names: `--model default|PATH`, `--draft default|PATH|none`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash.drafter.loader import (
    DEFAULT_DRAFTER,
    GEMMA3_270M_DRAFTER,
    PACKAGED_DRAFTERS,
    load_drafter,
    resolve_drafter_path,
)
from dflash.drafter.model import DFlashDrafter
from dflash.engine.devices import pick_device, pick_dtype
from dflash.engine.engine import AMX_DDTREE_BUDGET, Engine, EngineOptions
from dflash.engine.heap import return_free_heap
from dflash.errors import DFlashError, ModelLoadError
from dflash.kernels.openmp import release_thread_workers
from dflash.models.cpu_matmul import choose_cpu_matmul, draft_products, tile_products, use_cpu_matmul
from dflash.models.model import CausalLM
from dflash.models.packaged import GEMMA3_270M_NAME
from dflash.models.quantized_model import build_quantized_model
from dflash.models.quantized_weights import QuantizedCheckpoint
from dflash.models.registry import build_model
from dflash.models.resolve import load_checkpoint, resolve_model_path
from dflash.models.weight_choice import WeightChoice, choose_weights
from dflash.parallel.group import TensorParallel

log = logging.getLogger("dflash.loading")


def is_default_model(name: str | None) -> bool:
    return name in (None, "", "default")


def packaged_drafter(model: str | None) -> str | None:
    """The shipped drafter of a packaged model (`--model default` / `gemma3-270m`), when its folder is present."""
    name = DEFAULT_DRAFTER if is_default_model(model) else GEMMA3_270M_DRAFTER if model == GEMMA3_270M_NAME else None
    return name if name is not None and (PACKAGED_DRAFTERS / name / "config.json").is_file() else None


@dataclass(frozen=True)
class LoadOptions:
    """Where and in which form `load_engine` loads the weights; "auto" picks for the machine.

    `weights`: auto, dense or quantized (see `dflash.models.weight_choice`). `draft_weights`: auto (Q8_0 blocks on the
    quantized CPU kernel when the target runs there; int8 rows on a GPU in 16-bit floats; dense otherwise), dense or
    quantized (Q8_0 blocks on the CPU, `dflash.drafter.quantize`; int8 rows on a GPU, `dflash.drafter.int8`).
    `draft_vocab`: auto (the drafter folder's `draft_vocab.safetensors` when it has one and the drafter runs on the
    CPU, where the LM head is a quarter of its round), off, or a shortlist file (`dflash.drafter.vocab`).
    `cpu_matmul`: the kernel of the quantized matrices on the CPU, target's and drafter's: auto, float32, amx or int8
    (`dflash.models.cpu_matmul`). `draft_device`: auto (the target's) or another GPU for the drafter, which then
    keeps copies of the target's embedding and LM head there (`dflash.generation.draft_device`)."""

    device: str = "auto"  # auto or a torch device name: cpu, cuda, cuda:1
    dtype: str = "auto"  # auto (bfloat16 on CUDA, else float32) or a name of `dflash.engine.devices.DTYPES`
    weights: str = "auto"
    draft_weights: str = "auto"
    draft_vocab: str = "auto"
    cpu_matmul: str = "auto"
    draft_device: str = "auto"


def load_engine(
    model: str | None = "default",
    draft: str | None = None,
    *,
    options: EngineOptions | None = None,
    loading: LoadOptions | None = None,
    tensor_parallel: TensorParallel | None = None,
) -> Engine:
    """Load target (and drafter) as `loading` says. With the default model and no `draft`, the shipped drafter is
    used when present; `draft="none"` disables speculative decoding.

    With `tensor_parallel` this process loads one rank's share of the target (`dflash.parallel`) on the rank's
    device, in dense weights, and a whole drafter beside it; forwards run eagerly (no CUDA graphs)."""
    engine = _load(model, draft, options or EngineOptions(), loading or LoadOptions(), tensor_parallel)
    return_free_heap()  # the loading's freed temporaries, its locals gone (`engine.heap`)
    return engine


def _load(
    model: str | None, draft: str | None, options: EngineOptions, loading: LoadOptions,
    tensor_parallel: TensorParallel | None,
) -> Engine:
    vocab = loading.draft_vocab
    if vocab not in ("auto", "off") and not Path(vocab).expanduser().is_file():
        raise ModelLoadError(f"--draft-vocab {vocab}: no such file (give auto, off or a draft_vocab.safetensors)")
    torch_device = pick_device(loading.device) if tensor_parallel is None else tensor_parallel.device
    torch_dtype = pick_dtype(loading.dtype, torch_device)
    draft_device = _draft_device(loading, torch_device, tensor_parallel)
    started = time.perf_counter()
    shard = None
    if tensor_parallel is None:
        choice = choose_weights(loading.weights, resolve_model_path(model or "default"), torch_device, torch_dtype)
    else:
        if loading.weights == "quantized":
            raise DFlashError("--tensor-parallel runs dense weights (give --weights auto or dense)")
        choice = WeightChoice("dense", f"tensor parallel, rank {tensor_parallel.rank} of {tensor_parallel.world}")
        shard = (tensor_parallel.rank, tensor_parallel.world)
        options = replace(options, cuda_graphs=False)
    draft_format = _drafter_weight_format(loading.draft_weights, choice.kind, torch_device, torch_dtype)
    # a rank's share is read straight in the run's dtype (half the host memory of float32 in bf16)
    load_dtype = torch.float32 if shard is None else torch_dtype
    checkpoint = load_checkpoint(
        model or "default", load_dtype, weights=choice.kind, shard=shard, quantized_for=torch_device.type
    )
    if checkpoint.tokenizer is None:
        raise DFlashError(f"{checkpoint.source}: no tokenizer found beside the weights")
    if draft is None or draft == "default":  # a packaged model's own drafter
        draft = packaged_drafter(model) or draft
    speculative = draft not in (None, "", "none") and options.spec != "none"
    products = None
    if (choice.kind == "quantized" and torch_device.type == "cpu") or draft_format == "q8_0":
        formats = checkpoint.matrix_formats() if isinstance(checkpoint, QuantizedCheckpoint) else frozenset()
        products = choose_cpu_matmul(loading.cpu_matmul, speculative=speculative, formats=formats)
    if isinstance(checkpoint, QuantizedCheckpoint):
        target = build_quantized_model(checkpoint, device=torch_device, dtype=torch_dtype)
        del checkpoint.weights
        checkpoint.matrices.clear()  # the model holds the rows it took: weight panels may replace them below
        if products is not None:  # the CPU kernel's products (a GPU's blocks go through the Triton programs)
            use_cpu_matmul(target, products.kind)
            return_free_heap()  # the GGUF rows weight panels replaced, before the drafter's temporaries
    else:
        target = build_model(
            checkpoint.config, checkpoint.weights, device=torch_device, dtype=torch_dtype,
            source=str(checkpoint.source), tensor_parallel=tensor_parallel,
        )
        del checkpoint.weights
    drafter = None
    if draft not in (None, "", "none"):
        assert draft is not None
        drafter = load_drafter(draft, checkpoint.config, device=draft_device, dtype=torch_dtype)
        if draft_format == "q8_0":  # before the shortlist, whose rows then come from the target's blocks
            from dflash.drafter.quantize import quantize_drafter

            log.info("drafter: %d projections as Q8_0 blocks", quantize_drafter(drafter))
            assert products is not None
            use_cpu_matmul(drafter, draft_products(products.kind))
        _attach_draft_vocab(drafter, target, draft, vocab)
        if draft_format == "int8":  # after the shortlist, whose rows are then rounded too
            from dflash.drafter.int8 import quantize_drafter_int8

            log.info("drafter: %d projections as int8 rows", quantize_drafter_int8(drafter))
    if products is not None and tile_products(products.kind) and options.ddtree_budget is None:
        options = replace(options, ddtree_budget=AMX_DDTREE_BUDGET)
    name = "smollm2-135m-instruct" if is_default_model(model) else Path(str(model)).name.removesuffix(".gguf")
    log.info("loaded %s in %.2f s on %s (%s, %s weights: %s%s)", name, time.perf_counter() - started, torch_device,
             torch_dtype, choice.kind, choice.reason,
             "" if products is None else f"; {products.kind} products: {products.reason}")
    engine = Engine(target, checkpoint.tokenizer, drafter, options, model_name=name)
    engine.cpu_matmul = None if products is None else products.kind
    release_thread_workers()  # the loading thread's OpenMP team would slow the decoding thread's (`kernels.openmp`)
    return engine


def _draft_device(loading: LoadOptions, target_device: torch.device, tensor_parallel: TensorParallel | None
                  ) -> torch.device:
    """Where the drafter runs: the target's device unless `--draft-device` names another GPU."""
    if loading.draft_device == "auto":
        return target_device
    if tensor_parallel is not None:
        raise DFlashError("--draft-device: under --tensor-parallel every rank runs the drafter beside its share")
    device = pick_device(loading.draft_device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type != "cuda" or target_device.type != "cuda":
        raise DFlashError(f"--draft-device {loading.draft_device}: the drafter can move to another GPU when the "
                          f"target runs on a GPU (the target runs on {target_device})")
    if device.index >= torch.cuda.device_count():
        raise DFlashError(f"--draft-device {loading.draft_device}: this machine has {torch.cuda.device_count()} GPUs")
    if loading.draft_vocab not in ("auto", "off"):
        raise DFlashError("--draft-device: a drafter on its own GPU scores the whole vocabulary (no --draft-vocab file)")
    return device


def _drafter_weight_format(choice: str, target_weights: str, device: torch.device, dtype: torch.dtype) -> str:
    """-> "dense", "q8_0" (blocks on the CPU kernel, float32 on the CPU) or "int8" (rows on the GPU's skinny
    program, 16-bit floats on CUDA)."""
    if choice not in ("auto", "dense", "quantized"):
        raise DFlashError(f"unknown --draft-weights {choice!r}; choose auto, dense or quantized")
    if choice == "dense":
        return "dense"
    if device.type == "cpu" and dtype == torch.float32:
        return "q8_0" if choice == "quantized" or target_weights == "quantized" else "dense"
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return "int8"  # same acceptance as bf16 rows, half the bytes (results/README.md, "Int8 drafter rows")
    if choice == "quantized":
        raise DFlashError(
            f"--draft-weights quantized runs on the CPU kernel in float32 or on a GPU in bfloat16/float16; this run "
            f"uses {device.type} / {str(dtype).removeprefix('torch.')} (or use --draft-weights dense)"
        )
    return "dense"


__all__ = ["LoadOptions", "load_engine", "resolve_model_path"]


def _attach_draft_vocab(drafter: DFlashDrafter, target: CausalLM, draft: str, choice: str) -> None:
    from dflash.drafter.vocab import DRAFT_VOCAB_FILE, read_draft_vocab

    if choice == "off":
        return
    if target.tensor_parallel is not None and target.layer_config.vocab_size != target.config.vocab_size:
        if choice != "auto":  # the shortlist would index rows of the LM head that this rank does not hold
            raise ModelLoadError("--draft-vocab: not with --tensor-parallel (the vocabulary is split across ranks)")
        return
    if choice == "auto":  # the folder's shortlist where the drafter runs on the CPU (measured there only)
        path = resolve_drafter_path(draft) / DRAFT_VOCAB_FILE
        if not path.is_file() or drafter.fc.weight.device.type != "cpu":
            return
    else:
        path = Path(choice).expanduser()
    ids = read_draft_vocab(path, target.config.vocab_size)
    drafter.use_draft_vocab(ids, target)
    log.info("drafter: scores %d of %d tokens (%s)", ids.numel(), target.config.vocab_size, path)
