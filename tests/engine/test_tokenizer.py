"""Tokenizer: ids, decoding and chat templates equal transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from service.errors import CheckpointError, InvalidRequest
from service.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing space ",
    "multiple   spaces\tand\ttabs\n\nnewlines\r\n",
    "naïve café résumé — “quotes” ‘single’ …",
    "emoji 😀🎉👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "中文字符和日本語のテキスト、한국어",
    "Ελληνικά, русский, עברית, العربية",
    "code: def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special tokens <|endoftext|> inside <|im_end|>text",
    "numbers 1234567890 3.14159 -42 1e-9",
    "\u200b zero width \ufeff bom \u00a0 nbsp",
    "a" * 300,
]

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another? 😀"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say <|im_end|> literally\n\n  with spaces  "},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    for add in (True, False):
        ids = ours.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
    ids = ours.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.slow
def test_decode_arbitrary_ids_matches_transformers(ours: Tokenizer, hf: Any) -> None:
    import random

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 20))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


@pytest.mark.slow
def test_metadata_matches_transformers(ours: Tokenizer, hf: Any, smollm2_dir: Path) -> None:
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert ours.eos_token_ids == frozenset([eos] if isinstance(eos, int) else eos) | {hf.eos_token_id}
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.vocab_size == len(hf)
    assert ours.has_chat_template
    assert ours.special_ids == frozenset(hf.all_special_ids) | {
        i for i, t in hf.added_tokens_decoder.items() if t.special
    }
    assert ours.id_to_token(ours.encode(" hello")[0]) == hf.convert_ids_to_tokens(hf.encode(" hello"))[0]
    assert ours.is_special(next(iter(ours.eos_token_ids)))


@pytest.mark.slow
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf: Any, chat: list[dict[str, str]], gen_prompt: bool
) -> None:
    expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen_prompt)
    assert ours.apply_chat_template(chat, add_generation_prompt=gen_prompt) == expected
    ids = ours.encode_chat(chat, add_generation_prompt=gen_prompt)
    ref = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)
    assert ids == list(ref)


# A template that exercises every helper transformers gives templates (tojson without HTML escaping, namespace,
# loop controls, raise_exception, strftime_now, the generation tag, special-token variables).
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(count=0) %}"
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "[SYS]{{ messages[0]['content'] }}[/SYS]\n{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set ns.count = ns.count + 1 %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}"
    "{% else %}<{{ m['role'] }}> {{ m | tojson }}\n{% endif %}"
    "{% if loop.index > 50 %}{% break %}{% endif %}"
    "{% endfor %}"
    "{% if tools is not none %}TOOLS{% endif %}"
    "{% if add_generation_prompt %}<assistant n={{ ns.count }} year={{ strftime_now('%Y') }}>{% endif %}"
)


def _tiny_folder(src: Path, dst: Path, config_extra: dict[str, Any], gen_eos: Any = None) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(config_extra)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if gen_eos is not None:
        (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return dst


@pytest.mark.slow
def test_rich_template_matches_transformers(smollm2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    # The list-of-named-templates form of tokenizer_config.json; "default" is the one used.
    folder = _tiny_folder(
        smollm2_dir,
        tmp_path / "rich",
        {"chat_template": [{"name": "default", "template": RICH_TEMPLATE}, {"name": "tool_use", "template": "x"}]},
        gen_eos=[2, 0],
    )
    ours = Tokenizer.from_folder(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    assert ours.eos_token_ids == frozenset({0, 2})
    for chat in CHATS[1:]:
        chat = [*chat, {"role": "assistant", "content": "  <b>&'quoted'</b>  "}, {"role": "user", "content": "ok"}]
        assert ours.apply_chat_template(chat) == hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate") as hf_err:
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(InvalidRequest, match="must alternate"):
        ours.apply_chat_template(bad)
    assert hf_err.value is not None


def _trained_folder(dst: Path, config: dict[str, Any]) -> Path:
    """A tiny byte-level BPE trained on the spot, so these tests need no downloaded model."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = RustTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(TEXTS, trainer=trainer)
    dst.mkdir()
    tk.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_no_chat_template_is_a_clear_invalid_request(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_trained_folder(tmp_path / "plain", {"bos_token": "<s>", "eos_token": "</s>"}))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(tok.encode("héllo 😀")) == "héllo 😀"
    assert tok.bos_token_id == 0 and tok.eos_token_ids == frozenset({1})


def test_missing_named_special_token_is_added(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(_trained_folder(tmp_path / "add", {"pad_token": {"content": "<pad>"}}))
    pad = tok.token_to_id("<pad>")
    assert pad is not None and tok.is_special(pad)
    assert tok.encode("a<pad>b").count(pad) == 1
    assert tok.decode(tok.encode("a<pad>b")) == "ab"


def test_template_messages_and_variables(tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ eos_token }}{{ extra }}"
    tok = Tokenizer.from_folder(_trained_folder(tmp_path / "tpl", {"eos_token": "</s>", "chat_template": template}))
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert tok.apply_chat_template(chat, extra="!") == "[user|a][assistant|b]</s>!"
    with pytest.raises(InvalidRequest, match="at least one"):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequest, match="content"):
        tok.apply_chat_template([{"role": "user"}])
    with pytest.raises(InvalidRequest, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def test_sandbox_blocks_escapes(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_folder(_trained_folder(tmp_path / "evil", {"chat_template": template}))
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    ns = Tokenizer.from_folder(
        _trained_folder(tmp_path / "ns", {"chat_template": "{% set n = namespace(_x=1) %}{{ n._x }}"})
    )
    with pytest.raises(InvalidRequest):
        ns.apply_chat_template([{"role": "user", "content": "x"}])


def test_broken_folders_fail_by_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)
    bad = _trained_folder(tmp_path / "badtpl", {"chat_template": "{% for x in %}"})
    with pytest.raises(CheckpointError, match="chat template"):
        Tokenizer.from_folder(bad)
    (bad / "chat_template.jinja").write_text("ok")  # the .jinja file wins over tokenizer_config's template
    assert Tokenizer.from_folder(bad).apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    with pytest.raises(CheckpointError, match="eos_token_id"):
        Tokenizer.from_folder(bad)


def test_json_nested_past_the_recursion_limit_is_a_checkpoint_error(tmp_path: Path) -> None:
    # Found while sharing the model config's JSON reader: the tokenizer's own let RecursionError escape.
    folder = _trained_folder(tmp_path / "deep", {})
    nested = '{"eos_token": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (folder / "tokenizer_config.json").write_text(nested)
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "generation_config.json").write_text(nested)
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        Tokenizer.from_folder(folder)
