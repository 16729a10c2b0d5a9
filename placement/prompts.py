"""Prompt files for `strata profile`: JSONL of chat messages, or plain text one prompt per line.

A file whose first non-blank line starts with `{` or `[` is JSONL; each line is then a list of
messages, or an object with "messages" (a list) or "prompt" (a string). A message is an object
with string "role" and "content". Blank lines are skipped; anything else wrong names its line.
"""
import json
from dataclasses import dataclass


class PromptFileError(ValueError):
    pass


@dataclass
class Prompt:
    line: int  # 1-based line in the file
    text: str = None  # plain text
    messages: list = None  # chat messages


def read_prompts(path):
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"{path}: cannot read the prompts ({exc})") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    if not numbered[0][1].lstrip().startswith(("{", "[")):
        return [Prompt(number, text=line) for number, line in numbered]
    return [_json_prompt(path, number, line) for number, line in numbered]


def _json_prompt(path, number, line):
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{path} line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        return Prompt(number, text=item["prompt"])
    messages = item.get("messages") if isinstance(item, dict) else item
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{path} line {number}: expected a list of chat messages, an object with "
                              f"\"messages\", or an object with \"prompt\"")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise PromptFileError(f"{path} line {number}: each message needs string \"role\" and \"content\", "
                                  f"got {json.dumps(message)[:80]}")
    return Prompt(number, messages=messages)
