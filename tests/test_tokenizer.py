"""Tokenizers built from GGUF metadata: parity with transformers, SentencePiece semantics, streaming."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest

from dflash.errors import GenerationError, ModelLoadError
from dflash.models.gguf_file import GGUFFile
from dflash.tokenizer import StreamDecoder, Tokenizer
from tests.loading_helpers import smollm2_path, tiny_model_gguf

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "  leading spaces",
    "trailing   ",
    "a  b   c    d",
    "tabs\tand\t\tnewlines\n\n\nend",
    "def f(x):\n    return x**2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "数字 12345 和 3.14159",
    "émoji 😀👍🏽 🇫🇷 naïve café",
    "Ünïcödé ß ∑ ∫ √ Ω",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "    \n  \n",
    "1234567890 000 1,000,000 2024-01-31",
    "It's don't we'll I'M THEY'RE",
    "https://example.com/path?q=1&r=2#frag",
    "\r\n\r\n",
    "x" * 60,
    "مرحبا بالعالم",
    "こんにちは世界",
    "🙂" * 5,
    " ",
    "",
    "\u00a0nbsp\u200bzero-width",
    "<html><body>hi</body></html>",
]


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_path()).metadata, source="smollm2")


@pytest.fixture(scope="module")
def reference() -> object:
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(smollm: Tokenizer, reference: object, text: str) -> None:
    ids = smollm.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    assert smollm.decode(ids) == reference.decode(ids)  # type: ignore[attr-defined]
    assert smollm.decode(ids) == text
    assert smollm.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


def test_smollm_conventions(smollm: Tokenizer) -> None:
    assert smollm.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]  # specials stay whole
    assert smollm.encode("12345") == [33, 34, 35, 36, 37]  # SmolLM2 splits digits one by one
    assert smollm.token_to_id("<|im_end|>") == 2 and smollm.id_to_token(2) == "<|im_end|>"
    assert smollm.token_to_id("no such token") is None
    assert smollm.encode("hi", add_special_tokens=True) == smollm.encode("hi")  # SmolLM2 adds no BOS
    assert smollm.decode([1, 4093, 2], skip_special_tokens=True) == "user"


def test_from_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    tiny_model_gguf(path, "llama")
    from_reader = Tokenizer.from_gguf_metadata(gguf.GGUFReader(path))
    from_ours = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    text = "The quick brown fox <|im_end|> 😀"
    assert from_reader.encode(text) == from_ours.encode(text)
    assert from_reader.eos_token_ids == from_ours.eos_token_ids


def test_bad_metadata() -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.ggml\.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelLoadError, match=r"without tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})


def test_no_chat_template_is_a_clear_error() -> None:
    tok = _spm_tokenizer(random.Random(0))[0]
    with pytest.raises(GenerationError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------------- SentencePiece BPE
def _spm_tokenizer(rng: random.Random) -> tuple[Tokenizer, dict[str, float], list[str]]:
    """A random SentencePiece-style vocabulary over a small alphabet, with distinct scores."""
    words = ["hello", "world", "help", "held", "low", "old", "howl", "dew"]
    pieces: set[str] = set("▁" + "".join(sorted(set("".join(words)))))
    for word in words:
        for w in (word, "▁" + word):
            for i in range(len(w)):
                for j in range(i + 2, min(len(w), i + 5) + 1):
                    if rng.random() < 0.6:
                        pieces.add(w[i:j])
    normal = sorted(pieces)
    rng.shuffle(normal)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    user = ["  ", "   ", "<tag>"]  # whitespace runs are stored with real spaces
    tokens = specials + byte_tokens + user + normal
    types = [3, 3, 3, 2, 3] + [6] * 256 + [4] * len(user) + [1] * len(normal)
    scores = [-1000.0] * (len(specials) + 256 + len(user)) + [-float(i) for i in range(len(normal))]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    score_of = {t: s for t, s, k in zip(tokens, scores, types, strict=True) if k == 1}
    return Tokenizer.from_gguf_metadata(md, source="spm"), score_of, tokens


def _spm_reference(text: str, scores: dict[str, float], tokens: list[str]) -> list[int]:
    """SentencePiece BPE: user-defined pieces first, then merge the best-scored adjacent pair, leftmost first."""
    index = {t: i for i, t in enumerate(tokens)}
    ids: list[int] = []
    for segment in _split_user_defined(text.replace(" ", "▁")):
        if segment in ("▁▁", "▁▁▁", "<tag>"):
            ids.append(index[segment.replace("▁", " ")] if "▁" in segment else index[segment])
            continue
        symbols = list(segment)
        while True:
            best: tuple[float, int] | None = None
            for i in range(len(symbols) - 1):
                score = scores.get(symbols[i] + symbols[i + 1])
                if score is not None and (best is None or score > best[0]):
                    best = (score, i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            if s in scores:
                ids.append(index[s])
            else:
                ids.extend(index[f"<0x{b:02X}>"] for b in s.encode())
    return ids


def _split_user_defined(text: str) -> list[str]:
    out, buf, i = [], "", 0
    while i < len(text):
        for piece in ("▁▁▁", "▁▁", "<tag>"):
            if text.startswith(piece, i):
                if buf:
                    out.append(buf)
                out.append(piece)
                buf, i = "", i + len(piece)
                break
        else:
            buf += text[i]
            i += 1
    return out + ([buf] if buf else [])


@pytest.mark.parametrize("seed", range(5))
def test_sentencepiece_bpe_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    tok, scores, tokens = _spm_tokenizer(rng)
    alphabet = "helowrdp  ZÄ😀"
    samples = [
        "hello world",
        "held low dew",
        "howl  help",
        "x<tag>y",
        *["".join(rng.choices(alphabet, k=20)) for _ in range(40)],
    ]
    for text in samples:
        assert tok.encode(text) == _spm_reference(text, scores, tokens), text
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_conventions() -> None:
    tok, _, tokens = _spm_tokenizer(random.Random(1))
    assert tok.add_bos and tok.bos_token == "<bos>" and tok.eos_token == "<eos>"
    assert tok.eos_token_ids == (1, tokens.index("<end_of_turn>"))  # no template: end of turn counts as EOS
    assert tok.encode("hello", add_special_tokens=True)[0] == 2
    assert tok.encode("<end_of_turn>") == [tokens.index("<end_of_turn>")]
    assert tok.encode("Ä") == [tokens.index("<0xC3>"), tokens.index("<0x84>")]  # byte fallback
    assert tok.decode(tok.encode("hello  world")) == "hello  world"


# ------------------------------------------------------------------------------------------- streaming
def test_stream_decoder_multibyte(smollm: Tokenizer) -> None:
    text = "naïve 😀👍🏽 日本語 🇫🇷! done"
    ids = smollm.encode(text)
    assert len(ids) > len(text.split())  # characters really are split across tokens
    stream = StreamDecoder(smollm.decode)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # something was held back
    assert "".join(pieces) + stream.flush() == text
    assert stream.flush() == ""


def test_stream_decoder_incomplete_tail(smollm: Tokenizer) -> None:
    ids = smollm.encode("ok 😀")
    stream = StreamDecoder(smollm.decode)
    out = "".join(stream.push(i) for i in ids[:-1])
    assert out == "ok"  # the half-emoji is held back
    assert stream.flush().endswith("\ufffd")


def test_stream_decoder_sentencepiece_spaces() -> None:
    tok, _, _ = _spm_tokenizer(random.Random(2))
    text = "hello world  held Ä low"
    stream = StreamDecoder(tok.decode)
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) + stream.flush() == text
