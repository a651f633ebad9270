"""The model's tokenizer and chat template, read from an HF model folder without importing transformers.

``tokenizer.json`` is run by the ``tokenizers`` library (the same Rust code transformers' fast tokenizers use),
so ids and decoded text equal ``AutoTokenizer``'s. Chat templates are rendered with jinja2 in a sandbox set up
the way transformers sets it up (``trim_blocks``, ``lstrip_blocks``, loop controls, a ``tojson`` that does not
HTML-escape, ``raise_exception``, ``strftime_now``, a ``{% generation %}`` block tag), and receive the same
variables (``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the named special tokens),
so the rendered prompt equals ``apply_chat_template(..., tokenize=False)``.

Folder files read:
    tokenizer.json            required
    tokenizer_config.json     named special tokens, ``chat_template`` (a string or a list of named templates)
    chat_template.jinja       the default chat template; wins over tokenizer_config's, as in transformers
    generation_config.json    ``eos_token_id`` (an int or a list): every id that ends generation
    config.json               ``eos_token_id`` fallback when there is no generation_config.json

Decoding never applies transformers' ``clean_up_tokenization_spaces`` (transformers itself skips it for BPE
models, i.e. the Llama family), so decoding is a pure function of the ids, which incremental detokenization needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _RustTokenizer
from tokenizers.decoders import DecodeStream

from service.errors import CheckpointError, InvalidRequest
from service.hf_json import eos_token_ids, read_json_object

__all__ = ["Tokenizer"]

# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """Text ↔ ids for one model, plus its chat template and end-of-sequence ids.

    Attributes:
        eos_token_ids: every id that ends generation (tokenizer eos ∪ generation_config eos).
        bos_token_id: the beginning-of-sequence id, or None.
        vocab_size: how many ids the tokenizer can produce (base vocabulary + added tokens); the model's
            embedding may have more rows (padding), never fewer.
        has_chat_template: whether ``apply_chat_template`` can be used.
        special_tokens: the named special tokens (``bos_token``, ``eos_token``, ...) as strings.
    """

    def __init__(
        self,
        backend: _RustTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        name: str = "tokenizer",
    ) -> None:
        self._tk = backend
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos) if bos is not None else None
        eos_ids = set(eos_token_ids)
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (eos_id := backend.token_to_id(eos)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            try:
                self._template = _chat_environment().from_string(chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"chat template does not compile: {exc}", file=name) from exc

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the optional files listed in the module docstring from ``folder``."""
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(
                "no tokenizer.json: the model folder needs the fast (tokenizers) tokenizer file", file=tok_file
            )
        try:
            backend = _RustTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises plain Exception for any parse error
            raise CheckpointError(f"cannot parse: {exc}", file=tok_file) from exc

        config = read_json_object(folder / "tokenizer_config.json", missing_ok=True)
        special: dict[str, str] = {}
        for key in _NAMED_TOKENS:
            value = _token_content(config.get(key))
            if value is not None:
                special[key] = value
        # transformers adds named special tokens that tokenizer.json lacks; so do we, for identical ids.
        missing = [v for v in dict.fromkeys(special.values()) if backend.token_to_id(v) is None]
        if missing:
            backend.add_special_tokens([AddedToken(v, special=True, normalized=False) for v in missing])

        chat_template = _pick_chat_template(folder, config)

        eos_ids: list[int] = []
        gen_config_file = folder / "generation_config.json"
        fallback = folder / "config.json"
        source = gen_config_file if gen_config_file.is_file() else fallback
        eos_ids = eos_token_ids(read_json_object(source, missing_ok=True).get("eos_token_id"), source)
        return cls(
            backend, special_tokens=special, eos_token_ids=eos_ids, chat_template=chat_template, name=str(folder)
        )

    # ---- ids ----------------------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Text → ids, like ``AutoTokenizer.encode``: ``add_special_tokens`` runs tokenizer.json's post-processor
        (e.g. Llama 3 prepends ``<|begin_of_text|>``; SmolLM2 adds nothing). Special-token text in ``text`` is
        matched as the special token. Encode a rendered chat with ``add_special_tokens=False`` (see
        ``encode_chat``): the template already wrote its special tokens.

        Runs as a batch of one: the Rust side then releases the GIL (plain ``encode`` holds it, so a large prompt
        tokenized on a worker thread froze every other thread of the process, the event loop included), and the
        ``_fast`` variant skips the character offsets nobody reads. The ids are the same."""
        return list(self._tk.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids)

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what grammar backends build their token tables from)."""
        return str(self._tk.to_str())

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Ids → text. Byte sequences that are not valid UTF-8 (e.g. half of an emoji) decode to U+FFFD."""
        return str(self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(
        self, context_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> Callable[[int], str | None]:
        """A step function over ``tokenizers.decoders.DecodeStream``: each call adds one id and returns the text
        it completes, or None while that text would end inside a character (or be empty). ``context_ids`` are
        decoded as left context and never returned."""
        stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        tk = self._tk

        def step(token_id: int) -> str | None:
            out = stream.step(tk, token_id)
            return None if out is None else str(out)

        return step

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level alphabet for GPT-2-style BPE, e.g. 'Ġhello'), or None."""
        tok = self._tk.id_to_token(token_id)
        return None if tok is None else str(tok)

    def token_to_id(self, token: str) -> int | None:
        tid = self._tk.token_to_id(token)
        return None if tid is None else int(tid)

    def is_special(self, token_id: int) -> bool:
        """True for added special tokens (those ``decode(skip_special_tokens=True)`` drops)."""
        return token_id in self.special_ids

    # ---- chat ---------------------------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render a conversation to the prompt text the model was trained on.

        ``messages``: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``. ``extra`` variables
        reach the template too (and override the special tokens of the same name), as in transformers.
        Raises ``InvalidRequest`` when the model has no chat template, the messages are malformed, or the
        template itself rejects the conversation (``raise_exception``, e.g. roles that do not alternate).
        """
        if self._template is None:
            raise InvalidRequest(
                f"model {Path(self.name).name!r} has no chat template (no chat_template.jinja and no "
                "chat_template in tokenizer_config.json); send a raw prompt instead of chat messages"
            )
        if not messages:
            raise InvalidRequest("a chat needs at least one message")
        plain: list[dict[str, Any]] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping):
                raise InvalidRequest(f"message {i} must be a mapping with 'role' and 'content', got {type(msg)}")
            role, content = msg.get("role"), msg.get("content")
            if not isinstance(role, str) or not role:
                raise InvalidRequest(f"message {i} needs a non-empty string 'role'")
            if not isinstance(content, str):
                raise InvalidRequest(f"message {i} ({role}) needs a string 'content'")
            # transformers drops None-valued keys before rendering.
            plain.append({k: v for k, v in msg.items() if v is not None})
        # ``tools`` / ``documents`` are None unless given (transformers' defaults), and may be given in ``extra``.
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **extra}
        try:
            return self._template.render(messages=plain, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected this conversation: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        """``encode(apply_chat_template(messages), add_special_tokens=False)``, as transformers tokenizes chats."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt), add_special_tokens=False
        )


# ---- folder parsing --------------------------------------------------------------------------------------------------
def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a plain string or a serialized AddedToken {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config's "chat_template" (a string, or a
    list of {"name", "template"} of which "default" is used)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


# ---- the template sandbox -------------------------------------------------------------------------------------------
class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API declares it as a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace()`` minus underscore-prefixed attributes (a route to interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: ``self`` may be a kwarg name
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _check_attr(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attr(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attr(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set underscore attributes ({name!r})")


class _DictFactory:
    """``dict(...)`` / ``dict.fromkeys(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes '<', '>', '&' and "'", which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _SafeNamespace
    return env
