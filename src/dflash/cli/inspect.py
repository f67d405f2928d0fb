"""`dflash inspect`: print what a model file or drafter folder contains (config, tokenizer, sizes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser("inspect", help="describe a model or drafter", description=__doc__)
    parser.add_argument("path", nargs="?", default="default", help="HF folder, GGUF file, drafter folder or 'default'")
    parser.add_argument("--weights", default="auto", choices=["auto", "dense", "quantized"],
                        help="the weight path to describe (auto: what the engine would pick on this machine)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.is_dir() and (path / "config.json").is_file():
        raw = json.loads((path / "config.json").read_text())
        if "DFlashDraftModel" in raw.get("architectures", []) or "dflash_config" in raw:
            from dflash.drafter.model import DrafterConfig

            print(json.dumps({"kind": "dflash-drafter", **dataclasses.asdict(DrafterConfig.from_dict(raw))}, indent=2))
            return 0
    from dflash.engine.devices import pick_device, pick_dtype
    from dflash.models.quantized_weights import QuantizedCheckpoint
    from dflash.models.resolve import load_checkpoint, resolve_model_path
    from dflash.models.weight_choice import choose_weights

    device = pick_device("auto")
    choice = choose_weights(args.weights, resolve_model_path(args.path), device, pick_dtype("auto", device))
    checkpoint = load_checkpoint(args.path, weights=choice.kind, quantized_for=device.type)
    weights: dict[str, Any] = {"path": choice.kind, "reason": choice.reason}
    if isinstance(checkpoint, QuantizedCheckpoint):
        params = checkpoint.parameter_count()
        weights["matrix_types"] = checkpoint.type_counts()
        if device.type == "cpu":
            from dflash.kernels.build import load_quant_kernel

            weights["kernel_isa"] = load_quant_kernel().isa()
    else:
        params = sum(t.numel() for t in checkpoint.weights.values())
    info: dict[str, Any] = {"kind": "target", "source": str(checkpoint.source), "parameters": params}
    info["weights"] = weights
    info["config"] = dataclasses.asdict(checkpoint.config)
    if checkpoint.tokenizer is not None:
        tok = checkpoint.tokenizer
        info["tokenizer"] = {"vocab_size": tok.vocab_size, "eos_token_ids": list(tok.eos_token_ids),
                             "bos_token_id": tok.bos_token_id, "has_chat_template": tok.chat_template is not None}
    print(json.dumps(info, indent=2, default=str))
    return 0
