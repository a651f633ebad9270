"""Incremental detokenization: the streamed deltas add up to tokenizer.decode and never split a character."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from service.engine.detok import IncrementalDetokenizer
from service.tokenizer import Tokenizer

PIECES = [
    "Hello",
    " world",
    "!",
    " 😀",
    "🎉🎉",
    " 中文",
    "字符",
    "日本語",
    " 한국어",
    " 👩‍👩‍👧‍👦",
    "🇫🇷",
    " naïve",
    " café",
    "\n\n",
    "  ",
    " Ελληνικά",
    " русский",
    "€",
    "𝔘𝔫𝔦",
    "<|im_end|>",
    " ok.",
]


def _stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [det.push(i) for i in ids]
    deltas.append(det.flush())
    return deltas


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


@pytest.mark.slow
def test_random_texts_round_trip_without_broken_characters(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 12)))
        ids = tok.encode(text)
        for skip in (True, False):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            deltas = _stream(det, ids)
            final = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == final == det.text
            assert "\ufffd" not in final
            assert not any("\ufffd" in d for d in deltas), (text, deltas)
            assert det.held_tokens == 0


@pytest.mark.slow
def test_emoji_is_held_until_its_last_byte(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")
    assert len(ids) == 4  # 'a' + three byte-level pieces of the emoji
    det = IncrementalDetokenizer(tok)
    assert [det.push(i) for i in ids] == ["a", "", "", "😀"]
    assert det.flush() == ""


@pytest.mark.slow
def test_random_ids_including_invalid_utf8(tok: Tokenizer) -> None:
    # Arbitrary ids produce lone lead bytes and stray continuation bytes: the stream must still add up to the
    # full decode, U+FFFD included exactly where decode puts it.
    rng = random.Random(1)
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        det = IncrementalDetokenizer(tok)
        deltas = _stream(det, ids)
        final = tok.decode(ids)
        assert "".join(deltas) == final
        assert sum(d.count("\ufffd") for d in deltas) == final.count("\ufffd")


@pytest.mark.slow
def test_prompt_context_is_not_emitted(tok: Tokenizer) -> None:
    rng = random.Random(2)
    for _ in range(50):
        prompt = tok.encode("<|im_start|>user\n" + "".join(rng.choice(PIECES) for _ in range(5)))
        gen = tok.encode("".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 8))))
        det = IncrementalDetokenizer(tok, prompt)
        full, head = tok.decode(prompt + gen), tok.decode(prompt)
        assert "".join(_stream(det, gen)) == full[len(head) :] == tok.decode(gen)


@pytest.mark.slow
def test_window_stays_bounded_over_long_generations(tok: Tokenizer) -> None:
    ids = tok.encode("".join(PIECES) * 40)
    det = IncrementalDetokenizer(tok)
    for i in ids:
        det.push(i)
        assert len(det._context) + len(det._held) <= 48  # the ids it may decode again, not the whole generation
        assert det.held_tokens <= 3
    det.flush()
    assert det.text == tok.decode(ids)


@pytest.mark.slow
def test_skipped_special_tokens_in_a_row(tok: Tokenizer) -> None:
    ids = tok.encode("hi") + [2] * 30 + tok.encode(" there 😀") + [0, 1]
    det = IncrementalDetokenizer(tok)
    assert "".join(_stream(det, ids)) == tok.decode(ids) == "hi there 😀"


def _byte_fallback_folder(dst: Path) -> Path:
    """A Llama-2-style tokenizer: Metaspace words, <0xNN> byte-fallback tokens, SentencePiece decoder chain."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "e", "h", "l", "o", "é", "▁h", "▁he", "▁hel", "▁hello", "ll", "▁a", "▁é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("▁he", "l"), ("l", "l"), ("▁hel", "lo"), ("▁", "a"), ("▁", "é")]
    merges.insert(4, ("l", "o"))
    vocab["lo"] = len(vocab)
    tk = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("(?=▁)"), "isolated")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.add_special_tokens(["<s>", "</s>"])
    dst.mkdir()
    tk.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return dst


def test_byte_fallback_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_byte_fallback_folder(tmp_path / "bf"))
    text = "hello é 中文 😀 ab ché"
    ids = tok.encode(text, add_special_tokens=False)
    byte_ids = [i for i in ids if (t := tok.id_to_token(i)) is not None and t.startswith("<0x")]
    assert len(byte_ids) >= 10  # CJK and the emoji really go through byte fallback
    assert tok.decode(ids) == text
    det = IncrementalDetokenizer(tok)
    deltas = _stream(det, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    # The decoder strips the leading space of a sequence's first token; with the prompt as left context the
    # first generated word keeps its space, exactly as in decoding prompt + generation together.
    prompt = tok.encode("hello", add_special_tokens=False)
    gen = tok.encode("a é 😀", add_special_tokens=False)  # the normalizer prepends "▁": [▁a, ▁é, ▁, <0xF0>, ...]
    det = IncrementalDetokenizer(tok, prompt)
    full = tok.decode(prompt + gen)
    assert "".join(_stream(det, gen)) == full[len(tok.decode(prompt)) :] == " a é 😀"


@pytest.mark.slow
def test_unfinished_character_at_the_end_is_flushed(tok: Tokenizer) -> None:
    # DecodeStream alone has no flush: the ids of a cut-off emoji never come out of it. flush() emits them as
    # the full decode does (U+FFFD), and restarts the stream, so text pushed afterwards is not emitted twice.
    ids = tok.encode("hi 😀")[:-1]
    step = tok.decode_stream()
    assert [step(i) for i in ids][-1] is None
    det = IncrementalDetokenizer(tok)
    deltas = _stream(det, ids)
    assert "".join(deltas) == tok.decode(ids) and deltas[-1].endswith("\ufffd")
    more = tok.encode(" there")
    assert "".join(_stream(det, more)) == " there"
    assert det.text == tok.decode(ids) + " there"


@pytest.mark.slow
def test_invalid_bytes_are_not_held_for_ever(tok: Tokenizer) -> None:
    stray = tok.token_to_id("Ģ")  # byte 0x80: a continuation byte, on its own never a character
    assert stray is not None
    ids = tok.encode("hi") + [stray] * 12 + tok.encode(" there")
    det = IncrementalDetokenizer(tok)
    deltas = []
    for i in ids:
        deltas.append(det.push(i))
        assert det.held_tokens < 8
    deltas.append(det.flush())
    assert "".join(deltas) == tok.decode(ids) == "hi" + "\ufffd" * 12 + " there"
