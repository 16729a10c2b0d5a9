"""Grammar-constrained sampling through llguidance: JSON schemas, any JSON object, Lark grammars.

- `Constraint`: a checked grammar, made without the model (on an HTTP thread); a grammar llguidance
  cannot compile raises `GrammarError` with llguidance's message (a schema past our size and depth
  limits: with ours).
- `GrammarVocab`: the model's vocabulary handed to llguidance once per loaded tokenizer; it makes a
  request's `Matcher` (the grammar against the vocabulary) and fills the masks of a step's constrained
  slots at once, with the GIL released (`fill_masks`: several in llguidance's thread pool, one in the
  calling thread).
- A mask is a bitmask row, int32 [W] with W = ceil(V / 32), bit t set when token t may come next;
  `allowed(row, V)` turns it into bool [V].
"""
import json
import logging
import weakref

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .errors import RequestError

log = logging.getLogger(__name__)

# Whitespace between JSON tokens, llama.cpp's: one space, or a newline and an indent of up to 20. Unbounded
# (llguidance's default) lets a weak or confused model write blanks until max_tokens.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
MAX_SCHEMA_BYTES = 64 * 1024  # a JSON schema's JSON text
MAX_SCHEMA_DEPTH = 32  # nesting levels of a JSON schema


class GrammarError(RequestError):
    """A grammar or JSON schema llguidance cannot compile; the message is llguidance's."""


class Constraint:
    """A grammar a request's output must follow (llguidance's grammar text), checked when made."""

    def __init__(self, grammar, kind):
        message = llguidance.LLMatcher.validate_grammar(grammar)
        if message:
            raise GrammarError(f"invalid {kind}: {message.strip()}")
        self.grammar, self.kind = grammar, kind

    @classmethod
    def from_json_schema(cls, schema):
        """Output that parses as JSON and validates against `schema` (a dict, True for any JSON, or the JSON
        text of one), within MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH."""
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
            schema = {} if schema is True else schema
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        problem = schema_past_limits(schema)
        if problem:
            raise GrammarError(f"the JSON schema {problem}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
        return cls(grammar, "JSON schema")

    @classmethod
    def json_object(cls):
        """Output that parses as one JSON object (OpenAI's `json_object` response format)."""
        return cls.from_json_schema({"type": "object"})

    @classmethod
    def from_lark(cls, text):
        """Output that matches a grammar in llguidance's Lark dialect (`%json {...}` embeds a JSON schema)."""
        if not isinstance(text, str):
            raise GrammarError(f"a Lark grammar must be text, got {type(text).__name__}")
        return cls(llguidance.LLMatcher.grammar_from_lark(text), "grammar")

    def __repr__(self):
        return f"Constraint({self.kind}, {len(self.grammar)} characters)"


def schema_past_limits(schema):
    """What puts a JSON schema past MAX_SCHEMA_BYTES or MAX_SCHEMA_DEPTH, as the end of a sentence about it
    ("has N bytes of JSON; ..."), or None within them."""
    size = len(json.dumps(schema).encode())
    if size > MAX_SCHEMA_BYTES:
        return f"has {size} bytes of JSON; the limit is {MAX_SCHEMA_BYTES}"
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        return f"is nested more than {MAX_SCHEMA_DEPTH} levels deep"
    return None


def _depth(value):
    """Nesting levels of a JSON value (a scalar: 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def lark_json(schema):
    """The Lark text `%json {...}` of a JSON schema (a dict), with the JSON options `from_json_schema` uses."""
    return "%json " + json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}})


class Matcher:
    """One request's place in its grammar; used by the engine thread only."""

    def __init__(self, ll):
        self.ll = ll

    @property
    def error(self):
        """llguidance's message once the matcher failed (it stays failed), else ''."""
        return self.ll.get_error() if self.ll.is_error() else ""

    @property
    def done(self):
        """The grammar is complete and allows nothing more (but an end token)."""
        return self.ll.is_stopped()

    def consume(self, token_id):
        """Advance by a sampled token; False when the grammar refuses it (see `error`)."""
        return self.ll.consume_token(int(token_id))


class GrammarVocab:
    """A tokenizer's vocabulary as llguidance holds it, with the thread pool that fills masks."""

    _by_tokenizer = weakref.WeakKeyDictionary()  # tokenizer -> {vocab_size: GrammarVocab}

    def __init__(self, tokenizer, vocab_size):
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                            eos_token=sorted(tokenizer.eos_ids))
        self.executor = llguidance.LLExecutor()

    @classmethod
    def of(cls, tokenizer, vocab_size):
        """The vocabulary of `tokenizer` for logits rows of `vocab_size`, built once per loaded tokenizer."""
        per_size = cls._by_tokenizer.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            per_size[vocab_size] = cls(tokenizer, vocab_size)
        return per_size[vocab_size]

    def matcher(self, constraint):
        """A new request's matcher; GrammarError when the grammar does not compile against this vocabulary."""
        ll = llguidance.LLMatcher(self.lltok, constraint.grammar, log_level=0)
        if ll.is_error():
            raise GrammarError(f"invalid {constraint.kind}: {ll.get_error().strip()}")
        for warning in ll.get_grammar_warnings():
            log.info("grammar warning: %s", warning)
        return Matcher(ll)

    def fill_masks(self, matchers):
        """The next-token masks of `matchers`: int32 [len(matchers), W], one row each, in their order."""
        masks = llnp.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) == 1:  # in this thread: waking llguidance's pool costs more than one mask
            llnp.fill_next_token_bitmask(matchers[0].ll, masks, 0)
        else:
            llnp.fill_next_token_bitmask_par(self.executor, [(m.ll, i) for i, m in enumerate(matchers)], masks)
        return masks

    def token_bytes(self, token_id):
        """The bytes a token stands for (a special token: its text)."""
        return self.lltok.decode_bytes([int(token_id)])


def allowed(mask, vocab_size):
    """A bitmask row int32 [W] -> bool [vocab_size]."""
    return np.unpackbits(mask.view(np.uint8), count=vocab_size, bitorder="little").view(bool)
