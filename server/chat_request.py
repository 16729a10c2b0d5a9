"""The tool and reasoning fields of a chat body, checked: messages with calls and results, `tools`,
`tool_choice`, `parallel_tool_calls`, `chat_template_kwargs`, `reasoning_effort`."""
import json
import re
from dataclasses import dataclass, field as dataclass_field

from hybrid.grammar import schema_past_limits

from .errors import bad_request as _bad
from .protocol import chat_messages, field

MAX_TOOLS = 128  # OpenAI's limit
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
REASONING_EFFORTS = ("low", "medium", "high")
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "raise_exception", "strftime_now"})


@dataclass
class ChatRequest:
    """`tools`: the OpenAI tool objects for the template (None: none rendered); `schemas`: name ->
    parameters of the tools the output may call (empty: calls are not parsed); `choice`: "auto", "none",
    "required" or a tool's name; `template_kwargs`: extra variables of the template."""

    messages: list
    tools: list | None = None
    schemas: dict = dataclass_field(default_factory=dict)
    choice: str = "auto"
    parallel: bool = True
    template_kwargs: dict = dataclass_field(default_factory=dict)

    @property
    def forced(self):
        """The tools one of which the output must call (None: free output)."""
        if self.choice == "required":
            return self.schemas
        if self.choice not in ("auto", "none"):
            return {self.choice: self.schemas[self.choice]}
        return None


def chat_request(body, template_variables):
    """The checked chat fields of `body`; `template_variables`: what the model's chat template reads."""
    tools = tool_list(body)
    if tools and "tools" not in template_variables:
        raise _bad("this model's chat template has no tool support: it cannot be given 'tools'", "tools")
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
               for t in tools}
    choice = tool_choice(body, schemas)
    parallel = field(body, "parallel_tool_calls", bool, True)
    use_tools = bool(tools) and choice != "none"
    return ChatRequest(messages(body), tools if use_tools else None, schemas if use_tools else {}, choice,
                       parallel, template_kwargs(body))


def tool_list(body):
    """The `tools` of a body, each a checked function tool."""
    tools = field(body, "tools", list, [])
    if len(tools) > MAX_TOOLS:
        raise _bad(f"field 'tools' may hold at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", "tools")
        if name in names:
            raise _bad(f"tools[{i}]: a second tool named '{name}'", "tools")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise _bad(f"tools[{i}].function.description must be a string", "tools")
        check_schema(function.get("parameters"), f"tools[{i}].function.parameters", "tools")
    return tools


def check_schema(schema, where, param):
    """A tool's parameters: a JSON object within the size and depth limits (None: no parameters)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise _bad(f"{where} must be a JSON schema object", param)
    problem = schema_past_limits(schema)
    if problem:
        raise _bad(f"{where} {problem}", param)


def tool_choice(body, schemas):
    """"auto", "none", "required" or the name of an offered tool."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad("field 'tool_choice' must be \"auto\", \"none\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        if name not in schemas:
            raise _bad(f"field 'tool_choice' names the tool '{name[:64]}', which is not in 'tools'", "tool_choice")
        return name
    if choice not in ("auto", "none", "required"):
        raise _bad("field 'tool_choice' must be \"auto\", \"none\", \"required\" or a named function",
                   "tool_choice")
    if choice == "required" and not schemas:
        raise _bad("tool_choice \"required\" needs at least one tool in 'tools'", "tool_choice")
    return choice


def messages(body):
    """The messages for the template: an assistant's call arguments as objects (templates iterate them),
    each tool result answering a call made before it."""
    checked, call_ids = [], set()
    for i, message in enumerate(chat_messages(body)):
        message = _template_fields(message)
        role = message["role"]
        if role == "assistant" and message.get("tool_calls") is not None:
            message = {**message, "tool_calls": _calls(message["tool_calls"], i)}
            call_ids.update(c["id"] for c in message["tool_calls"])
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise _bad(f"messages[{i}] (role tool) has tool_call_id {call_id!r}, which answers no tool call "
                           "of an earlier assistant message", "messages")
        checked.append(message)
    return checked


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first non-null one is the reasoning


def _template_fields(message):
    """As transformers hands a message to a template: keys whose value is null dropped (OpenAI clients send
    `content: null` beside tool calls, which templates test with `in`), the reasoning under both
    `reasoning_content` and `thinking` (gpt-oss's template reads that)."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _calls(calls, i):
    if not isinstance(calls, list):
        raise _bad(f"messages[{i}].tool_calls must be a list", "messages")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(call.get("id"), str):
            raise _bad(f"messages[{i}].tool_calls[{j}] must have a string 'id' and a function with a 'name'",
                       "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments must be the text of a JSON object",
                       "messages")
        checked.append({**call, "function": {**function, "arguments": arguments}})
    return checked


def template_kwargs(body):
    """`chat_template_kwargs` (enable_thinking, ...) and `reasoning_effort`, as template variables."""
    kwargs = dict(field(body, "chat_template_kwargs", dict, {}))
    reserved = sorted(RESERVED_TEMPLATE_NAMES & kwargs.keys())
    if reserved:
        raise _bad(f"field 'chat_template_kwargs' may not set '{reserved[0]}'", "chat_template_kwargs")
    effort = field(body, "reasoning_effort", str)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise _bad(f"field 'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        kwargs["reasoning_effort"] = effort
    return kwargs
