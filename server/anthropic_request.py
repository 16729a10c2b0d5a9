"""An Anthropic Messages body -> the chat body in OpenAI's shape that the chat path reads: `system`,
content blocks (text, tool_use, tool_result, thinking), `tools` with `input_schema`, `tool_choice`,
`stop_sequences`, `thinking`."""
from .errors import bad_request as _bad
from .protocol import MAX_INT32, field, integer

ROLES = ("user", "assistant")


def openai_body(body):
    """The chat body of an Anthropic Messages body, every field checked."""
    max_tokens = integer(body, "max_tokens", None, 1, MAX_INT32)
    if max_tokens is None:
        raise _bad("field 'max_tokens' is required", "max_tokens")
    chat = {"messages": _system(body) + _messages(body), "max_tokens": max_tokens,
            "stream": field(body, "stream", bool, False)}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = field(body, "stop_sequences", list, [])
    if stops:
        chat["stop"] = stops
    tools = field(body, "tools", list, [])
    if tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    chat.update(_tool_choice(body))
    thinking = field(body, "thinking", dict)
    if thinking is not None:
        if thinking.get("type") not in ("enabled", "disabled"):
            raise _bad("field 'thinking' must have type \"enabled\" or \"disabled\"", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return chat


def _system(body):
    system = body.get("system")
    if system is None:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _text(content, where):
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise _bad(f"{where} must be a string or a list of text blocks", where.split("[")[0].split(".")[0])


def _messages(body):
    messages = field(body, "messages", list)
    if not messages:
        raise _bad("field 'messages' must be a non-empty list", "messages")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _bad(f"messages[{i}] must be an object with role \"user\" or \"assistant\"", "messages")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
        elif isinstance(content, list):
            chat += _assistant(content, i) if message["role"] == "assistant" else _user(content, i)
        else:
            raise _bad(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    return chat


def _blocks(content, i, allowed):
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in allowed:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"messages[{i}].content[{j}]: a block of type {kind!r} is not supported here; "
                       f"this server reads {', '.join(allowed)}", "messages")
        yield j, block


def _user(content, i):
    """Tool results become `tool` messages (before the user's text, as Anthropic orders them)."""
    results, text = [], []
    for j, block in _blocks(content, i, ("text", "tool_result")):
        if block["type"] == "text":
            text.append(_text([block], "messages"))
            continue
        result = block.get("content", "")
        result = _text(result, f"messages[{i}].content[{j}].content") if result is not None else ""
        if block.get("is_error"):
            result = f"Error: {result}"
        results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
    return results + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant(content, i):
    text, reasoning, calls = [], [], []
    for j, block in _blocks(content, i, ("text", "tool_use", "thinking", "redacted_thinking")):
        if block["type"] == "text":
            text.append(_text([block], "messages"))
        elif block["type"] == "thinking":
            reasoning.append(block.get("thinking") or "")
        elif block["type"] == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise _bad(f"messages[{i}].content[{j}]: a tool_use block needs a string id and name and an "
                           "object input", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
    message = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool(tool, i):
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        raise _bad(f"tools[{i}] must be a custom tool with a name and an input_schema", "tools")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(body):
    choice = field(body, "tool_choice", dict)
    if choice is None:
        return {}
    kind = choice.get("type")
    chat = {"parallel_tool_calls": not field(choice, "disable_parallel_tool_use", bool, False)}
    if kind == "auto":
        return chat
    if kind == "any":
        return {**chat, "tool_choice": "required"}
    if kind == "none":
        return {"tool_choice": "none"}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {**chat, "tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise _bad("field 'tool_choice' must have type \"auto\", \"any\", \"none\" or \"tool\" (with a name)",
               "tool_choice")
