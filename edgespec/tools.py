"""Tool calls (OpenAI's `tools`), in the Hermes format that Qwen2.5 and many others use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that knows this format (it writes `<tool_call>` itself, as Qwen2.5's does) gets
`tools`, the history's tool calls and the tool results as they are. Any other template
gets them as text of ours in the same format: the tools in a system message, calls in
the assistant's turn, results in a user turn (llama.cpp's chat.cpp falls back to a
generic format the same way). A call is forced (tool_choice "required", or a named
function) by opening the answer with `<tool_call>` and constraining the rest with a
grammar of the calls allowed (call_grammar): a call's name and the arguments' keys and
punctuation are then drafted for free, and its arguments match the function's schema.
The parser is told the opening, so it reads the answer as the model's whole turn. Where
the model chooses (auto), it also reads the calls small models write their own way at the
start of an answer (a fenced JSON object, other wrapper tags, <function=NAME>), for the tools
declared (read_loose_call).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

from .errors import EdgespecError
from .grammar import json_schema_gbnf

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FALLBACK_SYSTEM = (
    "You may call functions to help with the user's request. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object of its name and arguments between tags, like this:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{...}}}}\n</tool_call>'
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto: the model decides; none: no calls; required: at least one; function: that one
    name: str | None = None  # the function, for mode "function"
    # the JSON schema of the calls allowed, {"name": ..., "arguments": ...} (required and function)
    call_schema: dict | None = field(default=None, compare=False)

    @property
    def opening(self) -> str:
        """The text the answer is forced to begin with (the rest follows call_grammar)."""
        return f"{OPEN}\n" if self.mode in ("required", "function") else ""

    @property
    def one_call(self) -> bool:
        """A named function is called once: the answer ends with its call."""
        return self.mode == "function"


def call_grammar(choice: ToolChoice, parallel: bool) -> str:
    """GBNF of a forced answer after its opening: a call, closed, and (for "required"
    with parallel calls) maybe more calls."""
    rules = json_schema_gbnf(choice.call_schema, name="tool-call")
    more = f' ("\\n{OPEN}\\n" tool-call "\\n{CLOSE}")*' if parallel and not choice.one_call else ""
    return f'root ::= tool-call "\\n{CLOSE}"{more}\n{rules}'


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters")
    arguments = parameters if isinstance(parameters, dict) and parameters else {"type": "object"}
    properties = {"name": {"const": function["name"]}, "arguments": arguments}
    return {"type": "object", "properties": properties, "required": ["name", "arguments"]}


def check(tools, tool_choice) -> ToolChoice:
    """Validate OpenAI's `tools` and `tool_choice`; one sentence on what is wrong."""
    if not isinstance(tools, (list, tuple)) or not all(_is_function(t) for t in tools):
        raise EdgespecError(
            '\'tools\' must be a list of {"type": "function", "function": {"name": ..., "parameters": ...}}'
        )
    functions = {t["function"]["name"]: t["function"] for t in tools}
    names = list(functions)
    if tool_choice in (None, "auto", "none", "required"):
        mode = tool_choice or "auto"
        if mode == "required" and not tools:
            raise EdgespecError("tool_choice 'required' needs at least one tool")
        if mode == "required" and len(tools) > 1:
            return ToolChoice(mode, call_schema={"anyOf": [_call_schema(f) for f in functions.values()]})
        if mode != "required":
            return ToolChoice(mode)
        name = names[0]  # required, of one tool: that one
    else:
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise EdgespecError(
            '\'tool_choice\' must be auto, none, required or {"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise EdgespecError(f"tool_choice names '{name}', which is not among the tools ({', '.join(names)})")
    return ToolChoice("function", name, _call_schema(functions[name]))


def tool_choice_of(tools, tool_choice) -> ToolChoice:
    """A ToolChoice as it is, else checked from OpenAI's fields (no tools: no calls)."""
    if isinstance(tool_choice, ToolChoice):
        return tool_choice
    return check(tools, tool_choice) if tools is not None else ToolChoice("none")


def _is_function(tool) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type", "function") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def knows_tools(template: str) -> bool:
    """Whether a chat template writes tool calls in this module's format itself."""
    return OPEN in template and "tools" in template


def prepare(template: str, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """The messages (and tools) to render `template` with: as they are for a template that
    knows tools, else written out as text in the same format."""
    native = knows_tools(template)
    out = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m.get("role") == "tool" and not native:
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        elif calls and native:  # the template writes `arguments` as JSON itself: give it the object
            out.append(
                m | {"content": m.get("content") or "", "tool_calls": [_with_object_arguments(c) for c in calls]}
            )
        elif calls:
            text = "\n".join(_call_text(c) for c in calls)
            out.append({"role": m["role"], "content": "\n".join(filter(None, [m.get("content"), text]))})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": m.get("content") or ""})
    if not tools or native:
        return out, tools or None
    system = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": out[0]["content"] + "\n\n" + system}, *out[1:]], None
    return [{"role": "system", "content": system}, *out], None


def _function(call: dict) -> dict:
    return call.get("function", call) if isinstance(call, dict) else {}


def _with_object_arguments(call: dict) -> dict:
    function = _function(call)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return call | {"function": function | {"arguments": arguments}}


def _call_text(call: dict) -> str:
    function = _with_object_arguments(call)["function"]
    body = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})
    return f"{OPEN}\n{body}\n{CLOSE}"


class ToolCallParser:
    """Splits an answer into its text and its tool calls as it streams. A call whose
    JSON does not parse stays text. names: the tools declared, whose calls are also read in
    the loose forms at the start of the answer (read_loose_call); while the start may still
    be one, its text is held back."""

    def __init__(self, opening: str = "", *, parallel: bool = True, names: Collection[str] = ()) -> None:
        self.parallel = parallel
        self.names = frozenset(names)
        self.calls: list[ToolCall] = []  # all so far
        self._buffer = opening
        self._in_call = False
        self._at_start = bool(self.names) and not opening  # only calls (or nothing) read so far

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New answer text -> (text to show now, calls completed now)."""
        self._buffer += text
        shown, calls = [], []
        self._read_loose(calls, final=False)
        while not self._at_start:
            if not self._in_call:
                at = self._buffer.find(OPEN)
                if at < 0:  # hold back what may be the start of an opening tag
                    keep = next((n for n in range(len(OPEN) - 1, 0, -1) if self._buffer.endswith(OPEN[:n])), 0)
                    cut = len(self._buffer) - keep
                    shown.append(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    break
                shown.append(self._buffer[:at])
                self._buffer, self._in_call = self._buffer[at + len(OPEN) :], True
            else:
                at = self._buffer.find(CLOSE)
                if at < 0:
                    break
                body, self._buffer, self._in_call = self._buffer[:at], self._buffer[at + len(CLOSE) :], False
                shown.append(self._take(body, calls, closed=True))
        return "".join(shown), calls

    def split(self, text: str, *, last: bool) -> tuple[str, list[ToolCall]]:
        """feed(text), and at the answer's end (last) finish() too: (text to show, calls completed)."""
        shown, calls = self.feed(text)
        if last:
            rest, more = self.finish()
            shown, calls = shown + rest, calls + more
        return shown, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the answer: what is left (an unclosed call is read as far as it goes)."""
        calls: list[ToolCall] = []
        self._read_loose(calls, final=True)
        shown, more = self.feed("")  # what the start held back, read as usual
        calls += more
        text = self._take(self._buffer, calls, closed=False) if self._in_call else self._buffer
        self._buffer, self._in_call = "", False
        return shown + text, calls

    def _take(self, body: str, calls: list[ToolCall], *, closed: bool) -> str:
        call = parse_call(body)
        if call is None:
            return f"{OPEN}{body}{CLOSE if closed else ''}"
        self._add(call, calls)
        return ""

    def _add(self, call: ToolCall, calls: list[ToolCall]) -> None:
        if self.parallel or not self.calls:
            self.calls.append(call)
            calls.append(call)

    def _read_loose(self, calls: list[ToolCall], *, final: bool) -> None:
        """At the answer's start: take the calls written in the loose forms, until the text is
        no such call (then it is read as usual) or may still become one (held back)."""
        while self._at_start:
            if self._buffer.lstrip().startswith(OPEN):  # the format of the prompt: read as usual
                self._at_start = False
                return
            found = read_loose_call(self._buffer, self.names, final=final)
            if found is Loose.INCOMPLETE:
                return
            if found is Loose.NOT_A_CALL:
                self._at_start = False
                return
            self._add(found.call, calls)
            self._buffer = self._buffer[found.end :]


def parse_call(body: str) -> ToolCall | None:
    """One call's JSON, {"name": ..., "arguments": {...}} (in a ```json fence or not), or None
    if it is not one."""
    fenced = FENCED.fullmatch(body)
    try:
        value, _ = json.JSONDecoder().raw_decode((fenced.group(1) if fenced else body).strip())
    except ValueError:
        return None
    return _call(value)


def _call(value, names: Collection[str] | None = None) -> ToolCall | None:
    """The call a decoded {"name": ..., "arguments" or "parameters": ...} object is (of one of
    `names`, if given), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


# --- the calls small models write instead ---------------------------------------------
# Asked with tool_choice auto, small models often write a call their own way (llama.cpp's
# Hermes/Qwen parser took these): an optional ```json / ```xml fence, an optional wrapper tag,
# then {"name": ..., "arguments" or "parameters": ...} naming a declared tool, or
# <function=NAME>{...}</function>. Read only at the start of the answer (a call there, or
# calls one after the other, is what the model meant as its turn; one quoted later is not).
LOOSE_OPENING = re.compile(r"\s*(```[A-Za-z_]*[ \t]*\n)?\s*(?:<(function_call|tools|json|tool_call)>)?\s*")
FUNCTION_TAG = re.compile(r"<function=([^>\s]+)>\s*")
LOOSE_TAGS = ("<function=", "<function_call>", "<tools>", "<json>", "<tool_call>")
LOOSE_STARTS = ("```", "{", *LOOSE_TAGS)
FENCED = re.compile(r"\s*```[A-Za-z_]*[ \t]*\n(.*?)\s*```\s*", re.S)


class Loose(Enum):
    INCOMPLETE = "more text may make it a call"
    NOT_A_CALL = "no text can"


@dataclass(frozen=True)
class LooseCall:
    call: ToolCall
    end: int  # the characters of the text it took, closing tags and fence included


def read_loose_call(text: str, names: Collection[str], *, final: bool) -> LooseCall | Loose:
    """The call `text` starts with in one of the loose forms (final: no more text comes)."""
    head = text.lstrip()
    if not head.startswith(LOOSE_STARTS):
        may_grow = not final and any(start.startswith(head) for start in LOOSE_STARTS)
        return Loose.INCOMPLETE if may_grow else Loose.NOT_A_CALL
    opening = LOOSE_OPENING.match(text)
    if head.startswith("```") and opening.group(1) is None:  # the fence's first line is not in yet
        return Loose.INCOMPLETE if not final and "\n" not in head else Loose.NOT_A_CALL
    at, rest = opening.end(), text[opening.end() :]
    if not final and any(tag.startswith(rest) and tag != rest for tag in LOOSE_TAGS):
        return Loose.INCOMPLETE  # a tag coming in pieces
    closers = [f"</{opening.group(2)}>"] if opening.group(2) else []
    name = None
    if rest.startswith("<function="):
        if (tag := FUNCTION_TAG.match(text, at)) is None:
            return Loose.INCOMPLETE if not final and ">" not in rest else Loose.NOT_A_CALL
        name, at = tag.group(1), tag.end()
        closers.insert(0, "</function>")
    try:
        value, at = json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        may_grow = not final and (text[at:].lstrip().startswith("{") or not text[at:].strip())
        return Loose.INCOMPLETE if may_grow else Loose.NOT_A_CALL
    call = _call(value if name is None else {"name": name, "arguments": value}, names)
    if call is None:
        return Loose.NOT_A_CALL
    for closer in closers + (["```"] if opening.group(1) else []):  # each may be left out
        rest = text[at:].lstrip()
        if rest.startswith(closer):
            at = len(text) - len(rest) + len(closer)
        elif not final and closer.startswith(rest):
            return Loose.INCOMPLETE
    return LooseCall(call, at)
