"""Prompt sources: ShareGPT (parsed tolerantly), HumanEval, MT-Bench, and JSONL prompt files.

A prompt file is JSONL with one object per line holding either `prompt` (a user message) or `messages`
(a chat). Training and evaluation stay disjoint: ShareGPT conversations whose index is a multiple of
`HELDOUT_EVERY` are reserved for evaluation and never returned by `sharegpt_training_prompts`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.errors import DFlashError
from dflash.tokenizer import Tokenizer, conversation_text

HELDOUT_EVERY = 50
Messages = list[dict[str, Any]]


def iter_sharegpt(path: Path) -> Iterator[tuple[int, Messages]]:
    """Yield (index, messages) for every conversation that parses, even from a truncated file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    index = 0
    while pos > 0:
        start = text.find("{", pos)
        if start < 0:
            return
        try:
            item, pos = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return  # the file is truncated inside this item
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list):
            roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "system": "system"}
            messages = [
                {"role": roles[t["from"]], "content": str(t.get("value", ""))}
                for t in turns
                if isinstance(t, dict) and t.get("from") in roles
            ]
            yield index, messages
        index += 1


def _first_user_turn(messages: Messages, max_chars: int) -> str | None:
    if not messages or messages[0]["role"] != "user":
        return None
    content = messages[0]["content"].strip()
    return content if 0 < len(content) <= max_chars else None


def sharegpt_training_prompts(path: Path, *, max_chars: int = 3000, all_turns: bool = True) -> list[str]:
    """User turns of non-held-out conversations (every turn, or only the first), each as its own prompt."""
    prompts: list[str] = []
    for i, messages in iter_sharegpt(path):
        if i % HELDOUT_EVERY == 0:
            continue
        turns = messages if all_turns else messages[:1]
        prompts += [
            m["content"].strip() for m in turns if m["role"] == "user" and 0 < len(m["content"].strip()) <= max_chars
        ]
    return prompts


def sharegpt_heldout_prompts(path: Path, *, count: int, max_chars: int = 3000) -> list[str]:
    out: list[str] = []
    for i, m in iter_sharegpt(path):
        if i % HELDOUT_EVERY == 0 and (p := _first_user_turn(m, max_chars)) is not None:
            out.append(p)
            if len(out) == count:
                break
    return out


def humaneval_prompts(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [
        "Complete the following Python function. Reply with the full function in a code block.\n\n"
        f"```python\n{p['prompt']}```"
        for p in problems
    ]


def mtbench_first_turns(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line)["turns"][0] for line in handle if line.strip()]


def prompt_ids(tokenizer: Tokenizer, chat: Messages) -> list[int]:
    """A prompt set's conversation as the target's input: rendered with the chat template, or for a base model
    without one, its text as a completion prompt (BOS first where the model wants one)."""
    if tokenizer.chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
    ids = tokenizer.encode(conversation_text(chat))
    bos = tokenizer.bos_token_id
    return [bos, *ids] if tokenizer.add_bos and bos is not None else ids


def read_prompt_file(path: Path) -> list[Messages]:
    """JSONL with `prompt` or `messages` per line -> chats."""
    chats: list[Messages] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DFlashError(f"{path}:{number}: not JSON ({exc.msg})") from None
            if isinstance(item.get("messages"), list):
                chats.append(item["messages"])
            elif isinstance(item.get("prompt"), str):
                chats.append([{"role": "user", "content": item["prompt"]}])
            else:
                raise DFlashError(f"{path}:{number}: expected a `prompt` string or a `messages` list")
    return chats


def write_prompt_file(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps({"prompt": prompt}, ensure_ascii=False) + "\n")
