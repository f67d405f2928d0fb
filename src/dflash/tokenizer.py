"""Text <-> token ids, built from a Hugging Face `tokenizer.json` or from GGUF metadata.

`Tokenizer` wraps a `tokenizers.Tokenizer` and adds what the engine needs around it: the BOS/EOS
conventions of the model, its chat template, and `StreamDecoder` for incremental detokenisation.

A GGUF file stores no `tokenizer.json`; its vocabulary lives in metadata under llama.cpp's keys:
`tokenizer.ggml.model` "gpt2" is byte-level BPE (tokens in the GPT-2 byte alphabet, merges listed,
text split by a regex chosen by `tokenizer.ggml.pre`); "llama" is SentencePiece-style BPE (spaces
spelled "▁", `<0xNN>` byte-fallback tokens, merges listed or else derived from the vocabulary, the
user-defined pieces first and then the normal pieces by score, as SentencePiece merges them); "gemma4" is that
kind too, with its merges listed.
Control tokens (type 3) become special added tokens and user-defined tokens (type 4) plain added
tokens, so that neither is ever split.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from dflash.chat_template import render_chat_template
from dflash.errors import GenerationError, ModelLoadError
from dflash.special_text import SpecialText, SpecialTextGuard

__all__ = ["END_OF_TURN_TOKENS", "StreamDecoder", "Tokenizer"]

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end an assistant turn in common chat formats (ChatML, Gemma, Llama 3, Phi).
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")

_SPM_SPACE = "\u2581"

# Pre-tokenisation regexes for byte-level vocabularies, by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that are GPT-2's regex, optionally after splitting every digit on its own.
_GPT2_PRE = {"gpt2", "default", "gpt-2", "starcoder", "refact", "olmo", "jais"}
_DIGIT_GPT2_PRE = {"smollm"}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special-token and chat conventions."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos: bool = False,
        source: str = "",
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.source = source
        self._special_text: SpecialText | None = None  # built on first use
        # the text of single ids: streaming decodes every committed token alone once (`StreamDecoder`), and a
        # vocabulary's worth of short strings is small
        self._single: dict[int, str] = {}

    # ----------------------------------------------------------------------------------- construction
    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load `tokenizer.json` and the conventions of `tokenizer_config.json` / chat template files."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise ModelLoadError(f"{tok_file}: cannot be read as a tokenizers file: {exc}") from None
        tok_config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        bos = _token_content(tok_config.get("bos_token", special_map.get("bos_token")))
        eos = _token_content(tok_config.get("eos_token", special_map.get("eos_token")))
        bos_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        if "add_bos_token" in tok_config:
            add_bos = bool(tok_config["add_bos_token"])
        else:  # follow the post-processor: does it put BOS in front of an empty text?
            ids = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=(eos_id,) if eos_id is not None else (),
            chat_template=_hf_chat_template(path, tok_config),
            add_bos=add_bos,
            source=str(path),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any] | Any, source: str = "GGUF file") -> Tokenizer:
        """Build from GGUF metadata: a mapping of key -> value, or a `gguf.GGUFReader`."""
        md = _plain_metadata(metadata)
        kind = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens list")
        tokens = [str(t) for t in tokens]
        types = [int(t) for t in md.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))]
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, types, md, source)
            default_add_bos = False
        elif kind in ("llama", "gemma4"):  # llama.cpp names Gemma 4's SentencePiece-style BPE (merges listed) apart
            backend = _sentencepiece_backend(tokens, types, md, source)
            default_add_bos = True
        else:
            raise ModelLoadError(
                f"{source}: tokenizer model {kind!r} is not supported (supported: gpt2, llama, gemma4)"
            )
        template = md.get("tokenizer.chat_template")
        template = str(template) if template else None
        bos_id = _opt_int(md.get("tokenizer.ggml.bos_token_id"))
        eos_ids = [
            i
            for i in (
                _opt_int(md.get(f"tokenizer.ggml.{key}"))
                for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            )
            if i is not None
        ]
        vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
        for text in END_OF_TURN_TOKENS:
            tid = vocab.get(text)
            if tid is not None and types[tid] == _CONTROL and (template is None or text in template):
                eos_ids.append(tid)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
            add_bos=bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)),
            source=source,
        )

    @classmethod
    def from_serialized(cls, backend_json: str, info: Mapping[str, Any]) -> Tokenizer:
        """Rebuild from `to_json()` and `info()` (used by the GGUF weight cache)."""
        bos = info.get("bos_token_id")
        return cls(
            tokenizers.Tokenizer.from_str(backend_json),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(int(i) for i in info.get("eos_token_ids", ())),
            chat_template=info.get("chat_template"),
            add_bos=bool(info.get("add_bos", False)),
            source=str(info.get("source", "")),
        )

    def to_json(self) -> str:
        return str(self.backend.to_str())

    def info(self) -> dict[str, Any]:
        """Everything but the backend, as JSON-compatible values."""
        return {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
            "add_bos": self.add_bos,
            "source": self.source,
        }

    def with_eos_token_ids(self, extra: Iterable[int]) -> Tokenizer:
        """A copy whose EOS ids are this tokenizer's followed by `extra` (duplicates dropped)."""
        return Tokenizer(
            self.backend,
            bos_token_id=self.bos_token_id,
            eos_token_ids=(*self.eos_token_ids, *extra),
            chat_template=self.chat_template,
            add_bos=self.add_bos,
            source=self.source,
        )

    # ------------------------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        tid = self.backend.token_to_id(token)
        return int(tid) if tid is not None else None

    def id_to_token(self, token_id: int) -> str | None:
        tok = self.backend.id_to_token(int(token_id))
        return str(tok) if tok is not None else None

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    # -------------------------------------------------------------------------------------- encoding
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised.

        With `add_special_tokens`, BOS is prepended when the model's convention asks for it. Text that
        came out of `apply_chat_template` already carries its BOS: encode it without.
        """
        ids: list[int] = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def special_text_guard(self) -> SpecialTextGuard:
        """A guard for one chat prompt: special tokens typed in its content are encoded as text
        (`dflash.special_text`)."""
        if self._special_text is None:
            self._special_text = SpecialText(self.backend)
        return self._special_text.guard()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if len(ids) == 1 and not skip_special_tokens:
            token = int(ids[0])
            text = self._single.get(token)
            if text is None:
                text = self._single[token] = str(self.backend.decode([token], skip_special_tokens=False))
            return text
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation with the model's chat template (see `dflash.chat_template`)."""
        if not self.chat_template:
            raise GenerationError(
                f"the tokenizer of {self.source or 'this model'} has no chat template; "
                "use plain text completion or a chat/instruct model"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **template_kwargs,
        )


class StreamDecoder:
    """Incremental detokeniser: feed ids one at a time, get back the text they complete.

    Text is decoded over a short window of recent ids (so SentencePiece spaces and multi-token
    characters come out right) and held back while it ends in U+FFFD, i.e. an incomplete UTF-8
    sequence, unless more than `max_pending` ids are waiting (then the text really is invalid).
    """

    def __init__(self, decode: Callable[[list[int]], str], max_pending: int = 8) -> None:
        self._decode = decode  # ids -> text, e.g. `Tokenizer.decode`
        self._max_pending = max_pending
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids before this one have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def push_complete(self, token_ids: Sequence[int]) -> str | None:
        """Several ids at once, decoded as one window: their text where it ends in complete characters, which is
        the text pushing them one at a time gives (the window's text less the text already emitted: with no more
        than `max_pending` ids waiting, no push in between would have given up an incomplete character); None,
        with nothing taken, where it would end in U+FFFD or more ids would wait (then push them one at a time)."""
        if len(self._ids) + len(token_ids) - self._read > self._max_pending:
            return None
        start = len(self._ids)
        self._ids.extend(int(i) for i in token_ids)
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids[self._prefix :])
        if full.endswith("\ufffd"):
            del self._ids[start:]
            return None
        return self._advance(full)

    def flush(self) -> str:
        """Whatever is still held back (possibly ending in U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids[self._prefix :])
        pending = len(self._ids) - self._read
        if not final and full.endswith("\ufffd") and pending <= self._max_pending:
            return ""
        return self._advance(full)

    def _advance(self, full: str) -> str:
        """Emit `full` (the text of the window from `_prefix`) past the text of the ids emitted before."""
        seen = self._decode(self._ids[self._prefix : self._read])
        if not full.startswith(seen):  # a decoder that rewrites earlier text: emit what differs
            seen = seen[: len(_common_prefix(seen, full))]
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen) :]

# ------------------------------------------------------------------------------------------- helpers
def conversation_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation as plain text, for a base model without a chat template (prompt sets used as completion
    prompts): the messages' text, joined by blank lines."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
        if content:
            parts.append(str(content))
    return "\n\n".join(parts)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _opt_int(value: Any) -> int | None:
    return int(value) if value is not None else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return str(value) if value else None


def _hf_chat_template(path: Path, tok_config: Mapping[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_template = _read_json(path / "chat_template.json").get("chat_template")
    template = json_template if json_template is not None else tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return str(template) if template else None


def _plain_metadata(metadata: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    fields = getattr(metadata, "fields", None)
    if fields is not None:  # a gguf.GGUFReader
        return {str(k): f.contents() for k, f in fields.items()}
    if isinstance(metadata, Mapping):
        return metadata
    raise TypeError(f"expected GGUF metadata as a mapping or a GGUFReader, got {type(metadata).__name__}")


def _added_tokens(tokens: Sequence[str], types: Sequence[int], skip: set[int]) -> list[AddedToken]:
    added = []
    for tid, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if tid in skip or kind not in (_CONTROL, _USER_DEFINED):
            continue
        added.append(AddedToken(text, special=kind == _CONTROL, normalized=False))
    return added


def _split_merge(line: Any, source: str) -> tuple[str, str]:
    left, sep, right = str(line).partition(" ")
    if not sep:
        raise ModelLoadError(f"{source}: malformed merge {line!r} in tokenizer.ggml.merges")
    return left, right


def _byte_level_backend(
    tokens: list[str], types: list[int], md: Mapping[str, Any], source: str
) -> tokenizers.Tokenizer:
    merges_raw = md.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, list):
        raise ModelLoadError(f"{source}: byte-level (gpt2) tokenizer without tokenizer.ggml.merges")
    merges = [_split_merge(line, source) for line in merges_raw]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    pre = str(md.get("tokenizer.ggml.pre", "default"))
    split = _SPLIT_BY_PRE.get(pre)
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=split is _LLAMA3_SPLIT))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        if pre not in _GPT2_PRE and pre not in _DIGIT_GPT2_PRE:
            log.warning("%s: unknown pre-tokenizer %r; using GPT-2's", source, pre)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre in _DIGIT_GPT2_PRE
            else byte_level
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(_added_tokens(tokens, types, skip=set()))
    return backend


def _sentencepiece_backend(
    tokens: list[str], types: list[int], md: Mapping[str, Any], source: str
) -> tokenizers.Tokenizer:
    # Pieces made only of whitespace are stored with real spaces; the model sees spaces as "▁".
    spelled = [t.replace(" ", _SPM_SPACE) if t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in reversed(list(enumerate(spelled)))}
    scores = md.get("tokenizer.ggml.scores")
    score_list = [float(s) for s in scores] if scores is not None else [-float(i) for i in range(len(tokens))]
    if len(score_list) != len(tokens):
        raise ModelLoadError(f"{source}: {len(score_list)} token scores for {len(tokens)} tokens")
    merges_raw = md.get("tokenizer.ggml.merges")
    if isinstance(merges_raw, list) and merges_raw:
        merges = [_split_merge(m, source) for m in merges_raw]
    else:
        merges = _derive_merges(spelled, types, score_list)
    unk_id = _opt_int(md.get("tokenizer.ggml.unknown_token_id"))
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(model)
    add_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace]) if add_prefix else replace
    )
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    # User-defined whitespace pieces ("▁▁"...) are matched whole after normalisation, like SentencePiece does.
    respelled = {i for i, (a, b) in enumerate(zip(tokens, spelled, strict=True)) if a != b}
    backend.add_tokens(_added_tokens(tokens, types, skip=respelled))
    backend.add_tokens(
        [
            AddedToken(spelled[i], special=False, normalized=True)
            for i in sorted(respelled)
            if types[i] == _USER_DEFINED
        ]
    )
    return backend


def _derive_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary.

    SentencePiece joins the adjacent pair whose union is the best-scored piece, with user-defined
    pieces taking precedence. A BPE merge list ranked by the union's priority reproduces that.
    """
    mergeable = [i for i, k in enumerate(types) if k in (_NORMAL, _USER_DEFINED)]
    order = sorted(mergeable, key=lambda i: (types[i] != _USER_DEFINED, -scores[i], i))
    rank = {tokens[i]: r for r, i in enumerate(order)}
    merges: list[tuple[str, str]] = []
    for i in order:
        piece = tokens[i]
        if len(piece) < 2:
            continue
        pairs = [
            (piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in rank and piece[k:] in rank
        ]
        if len(pairs) > 1:
            pairs.sort(key=lambda lr: (rank[lr[0]], rank[lr[1]]))
        merges.extend(pairs)
    return merges
