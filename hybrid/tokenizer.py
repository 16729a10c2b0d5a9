"""Text <-> token ids, chat templates and streaming detokenization.

Byte-level BPE tokenizers (the `gpt2` model in GGUF, `tokenizer.json` in a
Hugging Face directory) run on the `tokenizers` library. Chat templates are
untrusted code from the model file and render in Jinja's immutable sandbox.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import jinja2.ext
import jinja2.meta
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .errors import ModelError, RequestError
from .special_text import SpecialTextEscaper

log = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Token texts that end a turn; like llama.cpp, any of them present as a special token stops generation.
END_OF_GENERATION_TEXTS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>", "<EOT>",
})
HARMONY_ENDS = frozenset({"<|end|>", "<|return|>", "<|call|>"})


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE splits text before merging: one regex, optional NFC, ignore_merges."""
    regex: str
    nfc: bool = False
    ignore_merges: bool = False


_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (tiktoken o200k_base, gpt-oss's tokenizer.json, llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O)
_O200K_UPPER, _O200K_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_O200K_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_LETTERS = (rf"[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}*{_O200K_LOWER}+{_O200K_SUFFIX}"
                  rf"|[^\r\n\p{{L}}\p{{N}}]?{_O200K_UPPER}+{_O200K_LOWER}*{_O200K_SUFFIX}")
_O200K_REGEX = _O200K_LETTERS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# Keyed by the value of `tokenizer.ggml.pre`.
PRE_TOKENIZERS = {
    "gpt2": PreTokenizer(_GPT2_REGEX),
    "default": PreTokenizer(_GPT2_REGEX),
    "qwen2": PreTokenizer(_QWEN2_REGEX, nfc=True),
    "llama-bpe": PreTokenizer(_LLAMA3_REGEX, ignore_merges=True),
    "gpt-4o": PreTokenizer(_O200K_REGEX),  # o200k (gpt-oss); llama.cpp keeps its merges' ranks (no ignore_merges)
}


def configure_byte_level(backend: BackendTokenizer, pre: str) -> None:
    """Give `backend` the normalizer, pre-tokenizer and decoder of the byte-level BPE named `pre`."""
    spec = PRE_TOKENIZERS[pre]
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec.regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()


# The most a text's UTF-8 size can shrink under NFC: max over Unicode of bytes(NFD(c)) / bytes(c), which is 3.0
# (U+0390: 2 bytes, 6 decomposed; Hangul syllables: 3 bytes, 9 as jamo).
NFC_MAX_SHRINK = 3


class ChatTemplateError(ModelError):
    """The chat template could not render the messages; `reason` says why without naming the model's file."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class PromptTooLong(RequestError):
    """A prompt of `num_tokens` tokens (`exact`, else at least that many) does not fit `limit` tokens."""

    def __init__(self, num_tokens: int, limit: int, exact: bool) -> None:
        super().__init__(f"the prompt has {'' if exact else 'at least '}{num_tokens} tokens; "
                         f"the context holds {limit}")
        self.num_tokens, self.limit, self.exact = num_tokens, limit, exact


class _TemplateRaised(Exception):
    pass


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Fails at once on any unsafe attribute, instead of returning a silent undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(template: str, source: str) -> jinja2.Template:
    """Compile an untrusted chat template the way Hugging Face does, in a sandbox."""
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ModelError(f"{source}: bad chat template: {exc}") from exc


class Tokenizer:
    """A byte-level BPE tokenizer with its special ids and chat template."""

    def __init__(self, backend: BackendTokenizer, *, source: str, pre: str | None, bos_id: int | None,
                 eos_id: int | None, pad_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None, extra_eos_ids: Iterable[int] = (),
                 vocab_size: int | None = None) -> None:
        self.backend = backend
        self.source = source
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        if add_bos and bos_id is None:
            log.warning("%s: the tokenizer asks for a BOS token but names none; adding no BOS", source)
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self.vocab_size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        self.eos_ids = frozenset(self._end_of_generation_ids(eos_id, extra_eos_ids))
        self.show_special(())
        self._template: jinja2.Template | None = None
        if self.add_bos:
            bos = backend.id_to_token(bos_id)
            backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
        else:
            backend.post_processor = None

    def _end_of_generation_ids(self, eos_id: int | None, extra: Iterable[int]) -> set[int]:
        ids = {i for i in (eos_id, *extra) if i is not None}
        specials = {added.content: token_id for token_id, added in self.backend.get_added_tokens_decoder().items()
                    if added.special}
        ends = END_OF_GENERATION_TEXTS
        if HARMONY_ENDS <= specials.keys():  # gpt-oss: <|end|> closes a message, not the answer
            ends = ends - {"<|end|>"}
            ids.discard(specials["<|end|>"])
        ids.update(token_id for text, token_id in specials.items() if text in ends)
        return ids

    def show_special(self, texts: Iterable[str]) -> None:
        """Streamed output (`IncrementalDecoder`) shows the text of these special tokens (the markers a
        tool-call or reasoning parser reads); other special tokens stay hidden."""
        shown = set(texts)
        self.hidden_special_ids = frozenset(token_id for token_id, added in
                                            self.backend.get_added_tokens_decoder().items()
                                            if added.special and added.content not in shown)

    def special_ids(self, texts: Iterable[str]) -> dict[str, int]:
        """text -> id of those of `texts` that are special tokens."""
        specials = {added.content: token_id for token_id, added in self.backend.get_added_tokens_decoder().items()
                    if added.special}
        return {text: specials[text] for text in texts if text in specials}

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], source: str) -> Tokenizer:
        """Build from GGUF metadata (key -> plain Python value); `source` names the file in errors."""
        model = fields.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError(f"{source}: no tokenizer (tokenizer.ggml.model is missing)")
        if model != "gpt2":
            raise ModelError(f"{source}: unsupported tokenizer model {model!r} in tokenizer.ggml.model; "
                             "Strata reads only 'gpt2' (byte-level BPE)")
        pre = fields.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ModelError(f"{source}: unknown pre-tokenizer {pre!r} in tokenizer.ggml.pre; "
                             f"Strata knows {', '.join(sorted(PRE_TOKENIZERS))}")
        tokens = _required_list(fields, "tokenizer.ggml.tokens", source)
        merges = [_split_merge(m, source) for m in _required_list(fields, "tokenizer.ggml.merges", source)]
        token_types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise ModelError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries "
                             f"for {len(tokens)} tokens")
        vocab = {text: i for i, text in enumerate(tokens)}
        bpe = models.BPE(vocab, merges, ignore_merges=PRE_TOKENIZERS[pre].ignore_merges)
        backend = BackendTokenizer(bpe)
        configure_byte_level(backend, pre)
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED])
        ids = {key: _token_id(fields, f"tokenizer.ggml.{key}_token_id", len(tokens), source)
               for key in ("bos", "eos", "eot", "eom", "padding")}
        return cls(backend, source=source, pre=pre, bos_id=ids["bos"], eos_id=ids["eos"], pad_id=ids["padding"],
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=fields.get("tokenizer.chat_template"),
                   extra_eos_ids=(ids["eot"], ids["eom"]), vocab_size=len(tokens))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model directory (tokenizer.json, tokenizer_config.json, ...)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(f"{path}: no tokenizer.json")
        text = tokenizer_file.read_text(encoding="utf-8")
        try:
            backend = BackendTokenizer.from_str(text)
        except Exception as exc:
            raise ModelError(f"{tokenizer_file}: cannot load: {exc}") from exc
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")

        def token_id(key: str) -> int | None:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos_id = token_id("bos_token")
        if bos_id is None and isinstance(generation.get("bos_token_id"), int):
            bos_id = generation["bos_token_id"]
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
        gen_eos = generation.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        return cls(backend, source=str(path), pre=_detect_pre(json.loads(text)), bos_id=bos_id,
                   eos_id=token_id("eos_token"), pad_id=token_id("pad_token"), add_bos=add_bos,
                   chat_template=_hf_chat_template(path, config),
                   extra_eos_ids=[i for i in gen_eos if isinstance(i, int)])

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True,
               token_limit: int | None = None) -> list[int]:
        """Token ids of `text`, BOS added when the model asks (`add_special`). `parse_special`: special tokens
        written in the text become control tokens. Raises PromptTooLong when `token_limit` tokens or more
        come out, before tokenizing when the text's size alone proves it."""
        if token_limit is not None:
            self._check_bound(len(text.encode("utf-8", "surrogatepass")), token_limit)
        backend = self.backend if parse_special else self._text_backend
        ids = backend.encode(text, add_special_tokens=add_special).ids
        if token_limit is not None and len(ids) >= token_limit:
            raise PromptTooLong(len(ids), token_limit, exact=True)
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    token_limit: int | None = None, **kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered by the chat template: the template's own markers are control
        tokens, special-token text inside the messages is plain text. `token_limit` as in `encode`."""
        return self.encode_rendered(self.render_chat(messages, add_generation_prompt, **kwargs), token_limit)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> str:
        """The chat template's text of `messages` (and `tools`, ...), special-token text in them escaped, for
        `encode_rendered`."""
        escaper = self._escaper
        return self.apply_chat_template(escaper.escape(messages), add_generation_prompt,
                                        tools=escaper.escape(kwargs.pop("tools", None)), **kwargs)

    def encode_rendered(self, rendered: str, token_limit: int | None = None) -> list[int]:
        """Token ids of a `render_chat` text: its markers are control tokens, the rest plain text."""
        escaper = self._escaper
        if token_limit is not None:
            self._check_bound(escaper.unescaped_size(rendered), token_limit)
        ids = [self.bos_id] if self.add_bos else []
        for piece, is_marker in escaper.split(rendered):
            ids += [self.backend.token_to_id(piece)] if is_marker else \
                self._text_backend.encode(piece, add_special_tokens=False).ids
        if token_limit is not None and len(ids) >= token_limit:
            raise PromptTooLong(len(ids), token_limit, exact=True)
        return ids

    def prepare(self) -> None:
        """Builds now what `encode_chat`, `parse_special=False` and `token_limit` use (0.7 s for a vocabulary
        of 150K tokens on 2 cores), so that a server's first request does not wait for it."""
        _ = self._text_backend, self._max_bytes_per_token, self._escaper

    def min_num_tokens(self, num_bytes: int) -> int:
        """A lower bound on the token count of any text of `num_bytes` UTF-8 bytes (0 when none is known)."""
        if self._max_bytes_per_token is None:
            return 0
        return -(-num_bytes // self._max_bytes_per_token)

    def _check_bound(self, num_bytes: int, token_limit: int) -> None:
        at_least = self.min_num_tokens(num_bytes)
        if at_least >= token_limit:
            raise PromptTooLong(at_least, token_limit, exact=False)

    @cached_property
    def _max_bytes_per_token(self) -> int | None:
        """The most text bytes one token can stand for, normalization included; None with a normalizer
        whose shrinking is unknown."""
        normalizer = self.backend.normalizer
        if normalizer is not None and not isinstance(normalizer, normalizers.NFC):
            return None
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)  # one character per byte
        longest = max(len(t) if byte_level else len(t.encode("utf-8"))
                      for t in self.backend.get_vocab(with_added_tokens=False))
        added = [len(a.content.encode("utf-8")) for a in self.backend.get_added_tokens_decoder().values()]
        return max([longest, *added]) * (NFC_MAX_SHRINK if normalizer is not None else 1)

    @cached_property
    def _text_backend(self) -> BackendTokenizer:
        """A copy of the backend that reads special-token text as text."""
        backend = BackendTokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _escaper(self) -> SpecialTextEscaper:
        return SpecialTextEscaper([a.content for a in self.backend.get_added_tokens_decoder().values()
                                   if a.special])

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (`tools`, `enable_thinking`, ...)."""
        if self.chat_template is None:
            return frozenset()
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        try:
            return frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.chat_template)))
        except TemplateError:
            return frozenset()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render `messages` with the model's chat template; extra kwargs (enable_thinking, ...) reach it."""
        if self.chat_template is None:
            raise ModelError(f"{self.source}: no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template, self.source)
        special = {"bos_token": self.bos_id, "eos_token": self.eos_id}
        context = {name: (self.token_text(i) if i is not None else "") for name, i in special.items()}
        context.update(kwargs, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**context)
        except _TemplateRaised as exc:
            reason = f"the chat template refused the messages: {exc}"
        except SecurityError as exc:
            reason = f"the chat template tried an unsafe operation: {exc}"
        except Exception as exc:
            reason = f"the chat template failed: {type(exc).__name__}: {exc}"
        raise ChatTemplateError(f"{self.source}: {reason}", reason)


class IncrementalDecoder:
    """Streaming detokenizer: `push(id)` returns the text that id completes ('' while a character is split).
    Special tokens are hidden (`skip_special`) but those the tokenizer shows (`Tokenizer.show_special`)."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._backend = tokenizer.backend
        self._hidden = tokenizer.hidden_special_ids if skip_special else frozenset()
        self._stream = decoders.DecodeStream(skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        if token_id in self._hidden:
            return ""
        return self._stream.step(self._backend, token_id) or ""


def _required_list(fields: dict[str, Any], key: str, source: str) -> list[Any]:
    value = fields.get(key)
    if not isinstance(value, list) or not value:
        raise ModelError(f"{source}: {key} is missing or empty")
    return value


def _split_merge(merge: str, source: str) -> tuple[str, str]:
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ModelError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not two tokens separated by a space")
    return merge[:cut], merge[cut + 1:]


def _token_id(fields: dict[str, Any], key: str, num_tokens: int, source: str) -> int | None:
    value = fields.get(key)
    if value is not None and not 0 <= value < num_tokens:
        raise ModelError(f"{source}: {key} = {value} is outside the vocabulary of {num_tokens} tokens")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}: bad JSON: {exc}") from exc


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _detect_pre(data: dict[str, Any]) -> str | None:
    """The `tokenizer.ggml.pre` name of a tokenizer.json's byte-level split, or None when unknown."""
    pre = data.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regexes = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    regexes += [_GPT2_REGEX for s in steps if s.get("type") == "ByteLevel" and s.get("use_regex", True)]
    if data.get("model", {}).get("type") != "BPE" or len(regexes) != 1:
        return None
    return next((name for name, spec in PRE_TOKENIZERS.items() if spec.regex == regexes[0]), None)
