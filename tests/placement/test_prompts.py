"""Prompt files: plain text and JSONL chat; empty or malformed files are refused with the line."""
import pytest

from placement.prompts import PromptFileError, read_prompts


def write(tmp_path, text):
    path = tmp_path / "prompts.txt"
    path.write_text(text)
    return path


def test_plain_text_one_per_line(tmp_path):
    prompts = read_prompts(write(tmp_path, "hello there\n\nsecond prompt\n"))
    assert [(p.line, p.text) for p in prompts] == [(1, "hello there"), (3, "second prompt")]


def test_jsonl_chat(tmp_path):
    path = write(tmp_path, '[{"role": "user", "content": "hi"}]\n'
                           '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}\n'
                           '{"prompt": "raw"}\n')
    prompts = read_prompts(path)
    assert prompts[0].messages == [{"role": "user", "content": "hi"}]
    assert len(prompts[1].messages) == 2 and prompts[2].text == "raw"


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file_is_refused(tmp_path, text):
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompts(write(tmp_path, text))


@pytest.mark.parametrize("bad_line, message", [
    ('{"messages": [{"role": "user"', "line 3: not valid JSON"),
    ('{"messages": []}', "line 3: expected a list of chat messages"),
    ('[{"role": "user", "content": 5}]', 'line 3: each message needs string "role" and "content"'),
    ('"just a string"', "line 3: expected a list of chat messages"),
])
def test_malformed_jsonl_names_the_line(tmp_path, bad_line, message):
    path = write(tmp_path, '[{"role": "user", "content": "ok"}]\n\n' + bad_line + "\n")
    with pytest.raises(PromptFileError, match=message):
        read_prompts(path)
