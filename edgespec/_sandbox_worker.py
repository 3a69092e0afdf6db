"""Works on untrusted input for edgespec in a process of its own (see sandbox.py):
renders chat templates ("render") and turns JSON schemas into grammars ("json_schema").

Run as a script, not imported: it needs only the standard library, jinja2 and the
schema converter's one pure-Python file (loaded by path, not with llama_cpp), so it
starts fast and never loads a model. Requests and answers are JSON lines on
stdin/stdout. Its address space is capped at start, so input that builds a huge
string or list fails here with MemoryError instead of taking memory from the program;
input that loops forever is killed by the parent after its time limit.
"""

import importlib.util
import json
import sys
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message):
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@lru_cache(maxsize=1)
def _converter(path):
    spec = importlib.util.spec_from_file_location("schema_converter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def json_schema(request):
    """The GBNF grammar of a JSON schema, by llama-cpp-python's converter (no remote $refs),
    its top rule named request["name"] ("" for root)."""
    converter = _converter(request["converter"]).SchemaConverter(
        prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    try:
        schema = converter.resolve_refs(request["schema"], "stdin")
    except AssertionError:  # what the converter raises for a remote $ref, naming a flag of its own
        raise ValueError("a $ref to a remote schema (edgespec fetches nothing): put that schema inline") from None
    converter.visit(schema, request["name"])
    gbnf = converter.format_grammar()
    if len(gbnf) > request["max_chars"]:
        return {"too_long": len(gbnf)}
    return {"gbnf": gbnf}


def render(request):
    text = _compile(request["template"]).render(
        messages=request["messages"],
        tools=request.get("tools"),
        add_generation_prompt=True,
        bos_token=request["bos_token"],
        eos_token=request["eos_token"],
    )
    if len(text) > request["max_chars"]:
        return {"too_long": len(text)}
    return {"text": text}


KINDS = {"render": render, "json_schema": json_schema}


def main():
    memory = int(sys.argv[1])
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    except (ImportError, ValueError, OSError):  # no such limit (Windows; macOS ignores it): the timeout holds
        pass
    sys.setrecursionlimit(2000)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            answer = KINDS[request["kind"]](request)
        except MemoryError:
            answer = {"error": "it needed more memory than it may use", "kind": "memory"}
        except RecursionError:
            answer = {"error": "it recursed too deeply", "kind": "recursion"}
        except Exception as e:  # the sandbox's SecurityError, TemplateError, OverflowError, TypeError, ...
            answer = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300], "kind": "error"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
