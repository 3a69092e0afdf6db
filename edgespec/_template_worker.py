"""Renders chat templates for edgespec in a process of its own (see chat.py).

Run as a script, not imported: it needs only the standard library and jinja2, so it
starts fast and never loads a model. Requests and answers are JSON lines on
stdin/stdout. Its address space is capped at start, so a template that builds a
huge string or list fails here with MemoryError instead of taking memory from the
program; one that loops forever is killed by the parent after its time limit.
"""

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
            answer = render(json.loads(line))
        except MemoryError:
            answer = {"error": "it needed more memory than a template may use", "kind": "memory"}
        except RecursionError:
            answer = {"error": "it recursed too deeply", "kind": "recursion"}
        except Exception as e:  # the sandbox's SecurityError, TemplateError, OverflowError, TypeError, ...
            answer = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300], "kind": "error"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
