"""Loading a Hugging Face model directory (config.json + safetensors + tokenizer) into a `Checkpoint`.

Weights come from `model.safetensors` or from the shards listed in `model.safetensors.index.json` (the language
model of an image-text checkpoint is read under its causal-LM names); experts of
mixture-of-experts models are stacked per projection as they are read in (`dflash.models.moe_weights`). A tensor-parallel
rank reads only its part of each split tensor (`dflash.parallel.sharding`), so no process holds the whole model.
EOS ids are merged from `config.json`, `generation_config.json` and the tokenizer's EOS token, so a
chat model stops on its end-of-turn token whichever file declares it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dflash.config import ModelConfig
from dflash.errors import ModelLoadError
from dflash.models.checkpoint import Checkpoint, expected_shapes, validate_weights
from dflash.models.moe_weights import is_expert_tensor, stack_expert_weights
from dflash.parallel.sharding import shard_config, shard_span
from dflash.tokenizer import Tokenizer

__all__ = ["load_hf_dir", "safetensors_files"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def load_hf_dir(path: Path, dtype: torch.dtype = torch.float32, *, shard: tuple[int, int] | None = None) -> Checkpoint:
    """Load a transformers-style checkpoint directory; weights are returned in `dtype`. `shard` = (rank, world)
    reads only that tensor-parallel rank's part of the split tensors (the config still describes the whole
    model)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory")
    config = ModelConfig.from_hf(
        _read_json(path / "config.json", required=True), source=str(path / "config.json")
    )
    generation = _read_json(path / "generation_config.json", required=False)
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None

    eos = [
        *(tokenizer.eos_token_ids if tokenizer else ()),
        *config.eos_token_ids,
        *_ids(generation.get("eos_token_id")),
    ]
    config = replace(config, eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos)))
    if config.bos_token_id is None and tokenizer is not None and tokenizer.bos_token_id is not None:
        config = replace(config, bos_token_id=tokenizer.bos_token_id)
    if tokenizer is not None:
        tokenizer = tokenizer.with_eos_token_ids(config.eos_token_ids)

    rank, world = shard or (0, 1)
    local = shard_config(config, world)
    wanted = expected_shapes(local)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as tensors:
                names = tensors.keys()  # a safetensors handle is not iterable
                for stored in names:
                    name = _text_model_name(stored)
                    # drops rotary buffers, a tied lm_head written anyway, vision and audio towers, etc.; experts
                    # are stacked below
                    if name in wanted or (config.is_moe and is_expert_tensor(name)):
                        weights[name] = _read_part(tensors, stored, shard_span(name, config, rank, world)).to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file}: cannot be read as safetensors: {exc}") from None
    if config.is_moe:
        weights = stack_expert_weights(local, weights, path)
    validate_weights(local, weights, path)
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=path)


def _text_model_name(name: str) -> str:
    """The causal-LM name of a tensor: multimodal checkpoints (Qwen3.5, Gemma 3 and 4 image-text models) keep the
    language model under `model.language_model.`."""
    prefix = "model.language_model."
    return "model." + name.removeprefix(prefix) if name.startswith(prefix) else name


def _read_part(tensors: Any, name: str, span: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor `name` of an open safetensors file, or only rows / columns [start, start + length) of it."""
    if span is None:
        return tensors.get_tensor(name)
    dim, start, length = span
    part = tensors.get_slice(name)
    if len(part.get_shape()) <= dim or part.get_shape()[dim] < start + length:
        raise ModelLoadError(f"{name} has shape {part.get_shape()}, too small for tensor-parallel rank parts")
    return part[start : start + length] if dim == 0 else part[:, start : start + length]


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory, checking that every indexed shard is present."""
    index_file = path / _INDEX
    if index_file.is_file():
        index = _read_json(index_file, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_file}: no weight_map")
        shards = list(dict.fromkeys(str(v) for v in weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"{path}: shard {missing[0]} listed in {_INDEX} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        return [path / s for s in shards]
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise ModelLoadError(f"{path}: no {_SINGLE}, {_INDEX} or other *.safetensors file")


def _read_json(file: Path, *, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise ModelLoadError(f"{file}: missing")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]
