"""gpt-oss's o200k tokenizer from a GGUF (tokenizer.ggml.pre "gpt-4o", as llama.cpp's converter names it): its
pre-tokenizer splits text as o200k's regex does (tiktoken's pattern, run by the `regex` module), and text
round-trips through the vocabulary."""
import pytest
import regex
from tokenizers import pre_tokenizers

from hybrid.demo_tokenizer import build_demo_tokenizer
from hybrid.tokenizer import Tokenizer
from tests.hybrid.test_tokenizer import read_gguf_fields, write_gguf

# tiktoken's o200k_base pattern, verbatim
O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
TEXTS = ["Hello WORLD it's 12345 apples", "HTTPServer's camelCase don'T\n\n  x", "a//b  ...\r\n/x",
         "naïve café 日本語 ١٢٣٤", "<|start|>user<|message|>hi<|end|>", "tabs\tand   spaces   \n"]


@pytest.fixture(scope="module")
def o200k(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "o200k.gguf"
    write_gguf(path, build_demo_tokenizer())
    fields = read_gguf_fields(path)
    return Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.pre": "gpt-4o"}), "gpt-oss.gguf")


@pytest.mark.parametrize("text", TEXTS)
def test_pre_tokenizer_splits_as_o200k(o200k, text):
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    expected = [piece for part in regex.findall(O200K, text) for piece, _ in to_bytes.pre_tokenize_str(part)]
    assert [p for p, _ in o200k.backend.pre_tokenizer.pre_tokenize_str(text)] == expected


def test_round_trip(o200k):
    assert o200k.pre == "gpt-4o"
    for text in TEXTS[:4]:
        assert o200k.decode(o200k.encode(text)) == text
