"""A small, real byte-level BPE tokenizer for Strata's built-in demo model.

It is trained at build time on the short corpus below, with the same
pre-tokenizer, normalizer and special tokens as Qwen3, so the demo model
exercises every path a real Qwen GGUF does. Training is deterministic: the
same `vocab_size` gives the same ids in every process.
"""
from tokenizers import AddedToken, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from .tokenizer import Tokenizer, configure_byte_level

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED_TOKENS = ("<think>", "</think>")

CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object inside <tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('System message must be first') }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments if fn.arguments is string else fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- raise_exception('Unexpected message role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes
each token to a few experts out of many, so only a small part of the weights is
used for any one token. The router picks the top k experts by score, and the
outputs of those experts are added together, weighted by the router's softmax.
Large models keep most experts in host memory and copy the hot ones to the GPU.
When the same experts are chosen again and again, keeping them resident saves
time; when the choice is spread evenly, the CPU does much of the work instead.

Once upon a time there was a little robot who wanted to learn how to read. Every
morning it opened a book, looked at the letters, and tried to guess the words.
"What does this say?" it asked the old librarian. "It says that patience is the
beginning of wisdom," she answered, smiling. The robot thought about it for a
long while, and then it turned the page.

Questions and answers:
Q: What is the capital of France? A: Paris is the capital of France.
Q: How many days are there in a week? A: There are seven days in a week.
Q: What is 12 + 30? A: 12 + 30 = 42.
Q: Who wrote the play Hamlet? A: William Shakespeare wrote Hamlet around 1600.
Q: Why is the sky blue? A: Sunlight is scattered by the air, and blue light is
scattered more than red light, so the sky looks blue during the day.

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024-05-17 3.14159 -7 1e-5
The meeting is on Monday at 10:30 am; the report is due on Friday, June 21st.
Prices went up by 3.5% in March, and the company sold 1,250 units for $49.99.

def softmax(x):
    \"\"\"Return the softmax of a list of numbers.\"\"\"
    m = max(x)
    exps = [math.exp(v - m) for v in x]
    total = sum(exps)
    return [e / total for e in exps]


class Router:
    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k

    def route(self, scores: list[float]) -> list[int]:
        order = sorted(range(self.num_experts), key=lambda i: -scores[i])
        return order[: self.top_k]


for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print(f"odd: {i}")

import json
import os

config = {"hidden_size": 2048, "num_layers": 48, "num_experts": 128, "top_k": 8}
with open(os.path.join("model", "config.json"), "w") as f:
    json.dump(config, f, indent=2)

#include <stdio.h>
int main(void) {
    for (int i = 0; i < 10; i++) {
        printf("%d\\n", i * i);
    }
    return 0;
}

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message.length;
}

SELECT name, count(*) AS total FROM users WHERE age >= 18 GROUP BY name ORDER BY total DESC;

{"role": "user", "content": "Write a haiku about the sea."}
{"role": "assistant", "content": "Waves fold into foam / the tide keeps its slow promise / salt on the cold wind"}
{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}

# Installing

Run `pip install strata` and then `strata serve --model model.gguf --port 8080`.
- Use `--gpu-memory 20GiB` to limit how much GPU memory the experts may use.
- Use `--threads 16` to set the number of CPU threads.

Some other languages: Le chat dort sur le canapé. Der Hund läuft schnell über
die Straße. El niño come una manzana. Привет, как дела? こんにちは世界。你好，世界！
Emoji are bytes too: 🙂 🚀 ✨ 👍🏽 — and so are symbols like €, £, ©, →, ≤, ∑.

She said that the weather would be better tomorrow, but nobody believed her,
because it had rained for nine days in a row. They stayed inside, played cards,
cooked soup, and told stories about the summer they had spent by the lake.
The students asked their teacher to explain the difference between a list and
a tuple. A list can be changed after it is created; a tuple cannot. Both keep
their items in order, and both can hold values of any type.

fn main() {
    let words = vec!["alpha", "beta", "gamma", "delta"];
    let lengths: Vec<usize> = words.iter().map(|w| w.len()).collect();
    match lengths.iter().max() {
        Some(longest) => println!("longest word has {} letters", longest),
        None => println!("no words"),
    }
}

#!/usr/bin/env bash
set -euo pipefail
for file in logs/*.txt; do
    grep -c "ERROR" "$file" || echo "no errors in $file"
done
export CUDA_VISIBLE_DEVICES=0,1
tar -czf backup.tar.gz ./data && echo "backup written"

server:
  host: 0.0.0.0
  port: 8080
  workers: 4
model:
  path: /models/qwen3-30b-a3b-q4_k_m.gguf
  context_length: 32768
  gpu_layers: all

| layer | experts | resident | hit rate |
|-------|---------|----------|----------|
| 0     | 128     | 32       | 0.71     |
| 1     | 128     | 28       | 0.64     |

async def fetch_all(session, urls):
    tasks = [asyncio.create_task(fetch(session, url)) for url in urls]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return {url: r for url, r in zip(urls, results) if not isinstance(r, Exception)}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 256
    stop: tuple[str, ...] = ()


try:
    value = int(text)
except ValueError as error:
    raise SystemExit(f"not a number: {text!r}") from error
finally:
    handle.close()

Recipe for a simple bread: mix five hundred grams of flour with a teaspoon of
salt, seven grams of dry yeast and three hundred millilitres of warm water.
Knead the dough for ten minutes until it is smooth and elastic, cover it, and
let it rise in a warm place for an hour. Shape the loaf, let it rise again for
thirty minutes, and bake it at two hundred and twenty degrees for forty minutes.

History notes: the printing press spread across Europe in the fifteenth century,
making books cheaper and helping ideas travel faster than ever before. Steam
engines powered the factories of the industrial revolution, railways connected
distant cities, and the telegraph carried messages across oceans in minutes.
In the twentieth century, electricity, radio, television, computers and finally
the internet changed how people work, learn, and talk to each other.

A short dialogue:
User: Can you help me plan a trip to the mountains next weekend?
Assistant: Of course! How many people are going, and do you prefer hiking,
climbing, or just relaxing with a view? I can suggest routes, cabins, and a
packing list with warm clothes, water, snacks, a map, and a first aid kit.
User: Two of us, mostly easy hikes, and we would like to stay somewhere quiet.
Assistant: Great choice. Start early on Saturday, take the lake trail (about
eight kilometres, gentle slopes), and book a small guesthouse in the valley.

Science: water boils at 100 degrees Celsius at sea level and freezes at zero.
Light travels about 299,792 kilometres per second. The Earth orbits the Sun
once every 365.25 days, and the Moon orbits the Earth roughly every 27 days.
Plants turn sunlight, water and carbon dioxide into sugar and oxygen; animals
breathe that oxygen and release carbon dioxide, closing a very old cycle.

Mathematics: the sum of the angles of a triangle is 180 degrees. A prime number
has exactly two divisors: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29 and 31 are primes.
If f(x) = x^2 + 3x - 4, then f(1) = 0 and f(-4) = 0, so (x - 1)(x + 4) = f(x).
The derivative of sin(x) is cos(x); the integral of 1/x is ln|x| + C.

Geography: the Amazon river flows through Brazil, Peru and Colombia; the Nile
crosses Egypt and Sudan; the Danube passes Vienna, Bratislava and Budapest.
Mount Everest rises 8,849 metres above the sea, while the Mariana Trench sinks
almost eleven kilometres below it. Deserts cover a third of the land surface.

Music and art: Beethoven composed nine symphonies, Mozart wrote operas such as
The Magic Flute, and Bach filled notebooks with fugues and cantatas. Painters
like Vermeer, Monet and Kahlo studied light, colour and everyday objects.
Poets count syllables, choose rhythms, and rhyme; novelists build whole worlds.
"""


def build_demo_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train the demo byte-level BPE; `vocab_size` counts every token, special ones included."""
    num_added = len(SPECIAL_TOKENS) + len(USER_DEFINED_TOKENS)
    backend = BackendTokenizer(models.BPE())
    configure_byte_level(backend, "qwen2")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    num_trained = backend.get_vocab_size()
    if num_trained != vocab_size - num_added:
        raise ValueError(f"demo tokenizer: the built-in corpus gives {num_trained + num_added} tokens, "
                         f"not vocab_size={vocab_size}")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_DEFINED_TOKENS])
    eos_id = backend.token_to_id("<|im_end|>")
    return Tokenizer(
        backend, source="built-in demo tokenizer", pre="qwen2",
        bos_id=None, eos_id=eos_id, pad_id=backend.token_to_id("<|endoftext|>"),
        add_bos=False, chat_template=CHAT_TEMPLATE,
    )
