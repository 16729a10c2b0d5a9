"""A chat body -> its prompt's token ids, the output reader of the model's dialect and, for a forced tool
call, the grammar; shared by /v1/chat/completions and /v1/messages."""
from dataclasses import dataclass

from hybrid.errors import ModelError
from hybrid.grammar import Constraint, GrammarError
from hybrid.tokenizer import ChatTemplateError, PromptTooLong

from .chat_output import ChatOutput
from .chat_request import chat_request
from .errors import ApiError, bad_request
from .tool_calls import Markers


@dataclass
class PreparedChat:
    prompt_ids: list
    output: ChatOutput
    constraint: Constraint | None


def prepare_chat(engine, dialect, body):
    """`body`: a chat body in OpenAI's shape; `dialect`: the model's (server/tool_calls.dialect_for)."""
    tokenizer = engine.tokenizer
    chat = chat_request(body, tokenizer.template_variables)
    try:
        rendered = tokenizer.render_chat(chat.messages, tools=chat.tools, **chat.template_kwargs)
        prompt_ids = tokenizer.encode_rendered(rendered, token_limit=engine.max_context)
    except PromptTooLong as exc:
        raise ApiError(400, f"{exc}: shorten the messages", "messages", "context_length_exceeded") from None
    except ChatTemplateError as exc:  # its reason names no file of the server
        raise bad_request(exc.reason, "messages") from None
    except ModelError:
        raise bad_request("this model has no chat template: use /v1/completions", "messages") from None
    thinking = dialect.thinking(rendered)
    constraint = None
    if chat.forced:
        constraint = forced_call(dialect, chat, tokenizer, thinking)
    return PreparedChat(prompt_ids, ChatOutput(dialect.parser(chat.schemas, thinking), chat.parallel), constraint)


def forced_call(dialect, chat, tokenizer, thinking):
    """The grammar of a call to one of `chat.forced` in the dialect; a tool whose parameters the grammar
    library cannot compile is a 400 that names it."""
    for name, schema in chat.forced.items():
        try:
            Constraint.from_json_schema(schema)
        except GrammarError as exc:
            raise bad_request(f"tool '{name}': its parameters cannot be enforced: {exc}", "tools") from None
    marker = Markers(tokenizer.special_ids(dialect.markers))
    return Constraint.from_lark(dialect.grammar(chat.forced, chat.parallel, marker, thinking))
