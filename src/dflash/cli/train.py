"""`dflash train`: train a DFlash drafter for a target we support.

    dflash train data   --model M --prompts FILE.jsonl[.gz] --out DATA.jsonl.gz   # the target answers prompts
    dflash train fit    --model M --data DATA.jsonl.gz --out RUN_DIR             # resumable training
                        [--arch dflash2]                                         # DFlash2: convolutions + selector
    dflash train export --model M --run RUN_DIR --out DRAFTER_DIR                # published layout, 15 MiB shards
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dflash.errors import DFlashError


def register(commands: Any) -> None:
    parser = commands.add_parser("train", help="train a DFlash drafter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    steps = parser.add_subparsers(dest="train_command", required=True)

    data = steps.add_parser("data", help="answer prompts with the target to build training data")
    _target_options(data)
    data.add_argument("--prompts", type=Path, required=True, action="append", help="prompt JSONL (repeatable)")
    data.add_argument("--out", type=Path, required=True)
    data.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    data.add_argument("--batch-size", type=int, default=64)
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--max-prompt-tokens", type=int, default=512)
    data.add_argument("--max-minutes", type=float, default=None, help="stop after this long (resumable)")
    data.set_defaults(run=run_data)

    fit = steps.add_parser("fit", help="train (or resume training) a drafter")
    _target_options(fit)
    fit.add_argument("--data", type=Path, required=True, action="append")
    fit.add_argument("--out", type=Path, required=True, help="run folder (checkpoint, history, loss.png)")
    fit.add_argument("--layers", type=int, default=None, help="drafter layers (default 4, or --init-from's)")
    fit.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default the target's)")
    fit.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                     help="dflash2: a DFlash2 drafter (block convolutions and a candidate selector, trained with the "
                          "selector's loss added; docs/dflash2.md)")
    fit.add_argument("--init-from", default=None,
                     help="start from this drafter (exported folder, training run folder or 'default'), grown to "
                          "--layers / --intermediate-size; with --arch dflash2 a DFlash drafter gives the shared "
                          "weights and the new parts start neutral")
    fit.add_argument("--validation", type=int, default=256, help="examples held out for the validation estimate")
    fit.add_argument("--block-size", type=int, default=None, help="default 16 (dflash) or 8 (dflash2)")
    fit.add_argument("--selector-rank", type=int, default=256, help="dflash2: rank of the selector's codebooks")
    fit.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates per block row")
    fit.add_argument("--selector-loss-weight", type=float, default=1.0,
                     help="dflash2: weight of the selector's loss added to the block loss")
    fit.add_argument("--mask-token", default=None, help="token text or id used as MASK (default: picked)")
    fit.add_argument("--steps", type=int, default=3000)
    fit.add_argument("--batch-size", type=int, default=16)
    fit.add_argument("--max-length", type=int, default=768)
    fit.add_argument("--anchors", type=int, default=48, help="anchor blocks per sequence")
    fit.add_argument("--lr", type=float, default=6e-4)
    fit.add_argument("--gamma", type=float, default=None, help="loss decay (default 7 for B=16, 4 for B=8)")
    fit.add_argument("--distill", type=float, default=0.0,
                     help="weight of KL to the target's next-token distribution, mixed with the hard labels (0-1)")
    fit.add_argument("--random-init", action="store_true", help="do not copy the target's last layers")
    fit.add_argument("--max-minutes", type=float, default=None, help="stop and checkpoint after this long")
    fit.add_argument("--seed", type=int, default=0)
    fit.set_defaults(run=run_fit)

    evaluate = steps.add_parser("eval", help="fast greedy acceptance by exact replay (batched answers)")
    _target_options(evaluate)
    evaluate.add_argument("--draft", required=True)
    evaluate.add_argument("--prompts-file", type=Path, action="append", required=True)
    evaluate.add_argument("--max-tokens", type=int, default=256)
    evaluate.add_argument("--batch-size", type=int, default=256)
    evaluate.add_argument("--limit", type=int, default=None, help="at most this many prompts per file")
    evaluate.add_argument("--ddtree-budgets", default="",
                          help="comma list of tree budgets to replay beside linear DFlash (e.g. 4,8,16,32,64)")
    evaluate.add_argument("--draft-weights", choices=["dense", "int8"], default="dense",
                          help="int8: replay with the drafter's products as int8 rows (`dflash.drafter.int8`)")
    evaluate.add_argument("--out", type=Path, default=None)
    evaluate.set_defaults(run=run_eval)

    export = steps.add_parser("export", help="write the trained drafter in the published layout")
    _target_options(export)
    export.add_argument("--run", dest="run_dir", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--export-dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    export.set_defaults(run=run_export)

    vocab = steps.add_parser(
        "vocab", help="the drafter's token shortlist: the most frequent tokens of the target's answers",
        description="Counts the answer tokens of answered data (`dflash train data`) and writes the SIZE most "
        "frequent as draft_vocab.safetensors (put it in the drafter's folder; see --draft-vocab).",
    )
    vocab.add_argument("--data", type=Path, required=True, action="append", help="answered data (repeatable)")
    vocab.add_argument("--size", type=int, required=True, help="tokens on the shortlist")
    vocab.add_argument("--out", type=Path, required=True, help="the draft_vocab.safetensors to write")
    vocab.set_defaults(run=run_vocab)


def _target_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")


def _load_target(args: argparse.Namespace) -> tuple[Any, Any]:
    from dflash.engine.devices import pick_device, pick_dtype
    from dflash.models.registry import build_model
    from dflash.models.resolve import load_checkpoint

    device = pick_device(args.device)
    checkpoint = load_checkpoint(args.model)
    model = build_model(checkpoint.config, checkpoint.weights, device=device, dtype=pick_dtype(args.dtype, device))
    return model, checkpoint.tokenizer


def run_data(args: argparse.Namespace) -> int:
    from dflash.training.datagen import generate_training_data
    from dflash.training.prompts import read_prompt_file

    model, tokenizer = _load_target(args)
    prompts: list[str] = []
    for path in args.prompts:
        prompts += [chat[-1]["content"] for chat in read_prompt_file(path) if chat and chat[-1]["role"] == "user"]
    prompts = prompts[: args.limit] if args.limit else prompts
    count = generate_training_data(
        model, tokenizer, prompts, args.out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, max_minutes=args.max_minutes,
    )
    print(json.dumps({"examples": count, "out": str(args.out)}))
    return 0


def pick_mask_token(tokenizer: Any, requested: str | None) -> int:
    """A token id whose (frozen) embedding serves as MASK: requested, or a rarely used special token."""
    if requested is not None:
        token_id = int(requested) if requested.isdigit() else tokenizer.token_to_id(requested)
        if token_id is None:
            raise DFlashError(f"--mask-token {requested!r} is not in the vocabulary")
        return int(token_id)
    for candidate in ("<empty_output>", "<jupyter_output>", "<|reserved_special_token_0|>", "<unused0>", "<mask>"):
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return int(token_id)
    return int(tokenizer.vocab_size - 1)


def run_fit(args: argparse.Namespace) -> int:
    from dflash.training.datagen import read_examples
    from dflash.training.trainer import DrafterTrainer, TrainSettings

    model, tokenizer = _load_target(args)
    examples = [ex for path in args.data for ex in read_examples(path)]
    if not examples:
        raise DFlashError("no training examples found in --data")
    drafter = _initial_drafter(args, model, tokenizer)
    gamma = args.gamma or (7.0 if drafter.config.block_size >= 16 else 4.0)
    settings = TrainSettings(
        steps=args.steps, batch_size=args.batch_size, max_length=args.max_length, anchors_per_sequence=args.anchors,
        lr=args.lr, gamma=gamma, distill=args.distill, seed=args.seed, validation=args.validation,
        selector_loss_weight=args.selector_loss_weight,
    )
    trainer = DrafterTrainer(model, drafter, examples, settings, args.out)
    resumed = trainer.try_resume()
    config = drafter.config
    print(f"{len(trainer.examples)} training / {len(trainer.validation)} held-out examples; "
          f"{'resuming at step ' + str(trainer.step) if resumed else 'starting'}; "
          f"{'DFlash2 ' if args.arch == 'dflash2' else ''}drafter {config.num_layers} layers, "
          f"MLP {config.intermediate_size}, {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M parameters",
          flush=True)
    history = trainer.train(max_minutes=args.max_minutes)
    summary = {"step": trainer.step, "loss": history.loss[-1:], "est_acceptance": history.est_acceptance[-1:],
               "held_out_acceptance": history.val_acceptance[-1:]}
    if args.arch == "dflash2":
        summary.update(selector_loss=history.selector_loss[-1:], selector_acceptance=history.selector_acceptance[-1:],
                       held_out_selector_acceptance=history.val_selector_acceptance[-1:])
    print(json.dumps(summary))
    return 0


def _initial_drafter(args: argparse.Namespace, model: Any, tokenizer: Any) -> Any:
    """A fresh drafter, or --init-from's weights grown to the requested shape (float32, on the target's device);
    with --arch dflash2 a DFlash one becomes the shared part of a DFlash2 drafter."""
    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.training.dflash2_init import DFLASH2_BLOCK_SIZE, dflash2_config, dflash2_from_dflash
    from dflash.training.growth import grow_drafter
    from dflash.training.run_drafter import load_start_drafter
    from dflash.training.trainer import init_drafter, new_drafter_config

    device = model.embed_tokens.weight.device
    dflash2 = args.arch == "dflash2"
    block_size = args.block_size or (DFLASH2_BLOCK_SIZE if dflash2 else 16)

    def as_dflash2(config: Any) -> Any:
        return dflash2_config(config, block_size=block_size, selector_rank=args.selector_rank,
                              selector_top_k=args.selector_top_k)

    if args.init_from is None:
        config = new_drafter_config(
            model, layers=args.layers or 4, block_size=block_size,
            mask_token_id=pick_mask_token(tokenizer, args.mask_token), intermediate_size=args.intermediate_size,
        )
        config = as_dflash2(config) if dflash2 else config
        return init_drafter(config, model, from_target_layers=not args.random_init, seed=args.seed).to(device)
    source = load_start_drafter(args.init_from, model.config, device)
    if isinstance(source, DFlash2Drafter) and not dflash2:
        raise DFlashError(f"--init-from {args.init_from} is a DFlash2 drafter: train it with --arch dflash2")
    drafter = grow_drafter(
        source, model, layers=args.layers or source.config.num_layers,
        intermediate_size=args.intermediate_size or source.config.intermediate_size, seed=args.seed,
    )
    if dflash2 and not isinstance(drafter, DFlash2Drafter):
        drafter = dflash2_from_dflash(drafter, as_dflash2(drafter.config), seed=args.seed)
    return drafter.to(device).requires_grad_(True)


def run_eval(args: argparse.Namespace) -> int:
    import statistics

    from dflash.bench.provenance import provenance
    from dflash.drafter.dflash2 import DFlash2Drafter
    from dflash.drafter.loader import load_drafter
    from dflash.generation.batched import BatchedDecoder, generate_batch
    from dflash.training.prompts import prompt_ids, read_prompt_file
    from dflash.training.replay import replay

    model, tokenizer = _load_target(args)
    drafter = load_drafter(args.draft, model.config, device=model.embed_tokens.weight.device,
                           dtype=model.embed_tokens.weight.dtype)
    if args.draft_weights == "int8":
        from dflash.drafter.int8 import quantize_drafter_int8

        quantize_drafter_int8(drafter)
    budgets = [int(b) for b in args.ddtree_budgets.split(",") if b.strip()]
    method = "exact replay of greedy linear DFlash" + (" and DDTree" if budgets else "")
    if isinstance(drafter, DFlash2Drafter):
        if budgets:
            raise DFlashError("--ddtree-budgets: the replay of a DFlash2 drafter's trees is not built")
        method = "exact replay of greedy linear DFlash2 (the selector's chain)"
    result: dict[str, Any] = {**provenance(model.embed_tokens.weight.device),
                              "dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
                              "method": method, "max_tokens": args.max_tokens, "draft_weights": args.draft_weights,
                              "sets": {}}
    every: list[float] = []
    every_tree: dict[int, list[float]] = {budget: [] for budget in budgets}
    for path in args.prompts_file:
        prompts = [prompt_ids(tokenizer, chat) for chat in read_prompt_file(path)][: args.limit]
        answers: list[list[int]] = []
        decoder = None  # reused by every full batch of this file (its captured steps too)
        for lo in range(0, len(prompts), args.batch_size):
            batch = prompts[lo : lo + args.batch_size]
            if decoder is None or not decoder.fits(len(batch), max(map(len, prompts)) + args.max_tokens):
                decoder = None
                decoder = BatchedDecoder(model, len(batch), max(map(len, prompts)) + args.max_tokens)
            answers += generate_batch(model, batch, max_new_tokens=args.max_tokens, eos_ids=tokenizer.eos_token_ids,
                                      decoder=decoder)
        taus: list[float] = []
        tree_taus: dict[int, list[float]] = {budget: [] for budget in budgets}
        for p, a in zip(prompts, answers, strict=True):
            linear, trees = replay(model, drafter, p, a, budgets, max_new_tokens=args.max_tokens)
            if linear.mean > 0:
                taus.append(linear.mean)
                for budget in budgets:
                    tree_taus[budget].append(trees[budget].mean)
        every += taus
        entry: dict[str, Any] = {"prompts": len(taus), "acceptance_length": round(statistics.fmean(taus), 4)}
        if budgets:
            entry["ddtree"] = {str(b): round(statistics.fmean(tree_taus[b]), 4) for b in budgets}
            for budget in budgets:
                every_tree[budget] += tree_taus[budget]
        result["sets"][path.name.split(".")[0]] = entry
        trees_note = "".join(f", ddtree {b}: {entry['ddtree'][str(b)]:.3f}" for b in budgets)
        print(f"{path.name}: linear {statistics.fmean(taus):.3f}{trees_note} over {len(taus)} prompts", flush=True)
    result["acceptance_length"] = round(statistics.fmean(every), 4)
    if budgets:
        result["ddtree_acceptance_length"] = {str(b): round(statistics.fmean(every_tree[b]), 4) for b in budgets}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from dflash.training.export import export_drafter
    from dflash.training.run_drafter import drafter_from_run

    drafter, state = drafter_from_run(args.run_dir)
    paths = export_drafter(drafter, args.out, dtype=getattr(torch, args.export_dtype))
    print(json.dumps({"files": [str(p) for p in paths], "step": state["step"]}))
    return 0


def run_vocab(args: argparse.Namespace) -> int:
    """Shortlist of the most frequent answer tokens; prints its size and the share of answer tokens it covers."""
    from collections import Counter

    from dflash.drafter.vocab import most_frequent_tokens, write_draft_vocab
    from dflash.training.datagen import read_examples

    if args.size < 1:
        raise DFlashError("--size must be at least 1")
    counts: Counter[int] = Counter()
    answers = 0
    for path in args.data:
        for _, response in read_examples(path):
            counts.update(response)
            answers += 1
    if not answers:
        raise DFlashError("no answered examples in " + ", ".join(str(path) for path in args.data))
    ids = most_frequent_tokens(counts, args.size)
    total = sum(counts.values())
    covered = sum(counts[token] for token in ids.tolist())
    write_draft_vocab(ids, args.out)
    print(json.dumps({"tokens": ids.numel(), "answers": answers, "answer_tokens": total,
                      "coverage": round(covered / max(total, 1), 5), "out": str(args.out)}))
    return 0
