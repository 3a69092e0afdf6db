#!/usr/bin/env bash
# Real agents on `edgespec serve`: Claude Code (`claude -p`, Anthropic's Messages API) and Codex
# (`codex exec`, OpenAI's Responses API) each get a one-file task in a scratch folder of their
# own; reports whether each completed (the client exited 0 and the file was fixed), how long it
# took, and the server's line for every answer (prompt tokens, cached, tok/s, drafters).
# Claude Code is offered three tools (a small model picks among 24 poorly) and asks for answers of
# 1,024 tokens at most (it asks for 32,000, which a small model that loops runs to).
# Not CI: it installs the clients with npm (into a folder of their own, not the project's
# dependencies) and takes minutes. Usage: scripts/agents-bench.sh [edgespec serve options...]
set -uo pipefail
clients=${EDGESPEC_CLIENTS:-${XDG_CACHE_HOME:-$HOME/.cache}/edgespec/clients}
port=${EDGESPEC_BENCH_PORT:-8089}
npm install --prefix "$clients" --no-fund --no-audit --silent @anthropic-ai/claude-code @openai/codex || exit 2
export PATH="$clients/node_modules/.bin:$PATH"

work=$(mktemp -d)
edgespec serve --port "$port" --parallel 1 --max-tokens 4096 "$@" 2>"$work/serve.log" &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server; echo "what the clients wrote, and the server log: $work"' EXIT
until grep -q "OpenAI API at" "$work/serve.log"; do
  kill -0 $server 2>/dev/null || { cat "$work/serve.log"; exit 2; }
  sleep 1
done
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'); $(grep '^edgespec serve:' "$work/serve.log")"
task="calc.py has a bug: add(a, b) returns a - b. Fix calc.py so that add returns a + b."

# Claude Code's recorded first request (20k tokens of system prompt and tools), then the session's
# second (one exchange longer, a new billing-header nonce): the time each took, and how much of its
# prompt came from the cache (after an earlier run, the cache kept on disk serves the first too)
recordings=${EDGESPEC_RECORDINGS:-$(dirname "$0")/../../shared/clients}
if [ -f "$recordings/claude-code-messages.json" ]; then
  python - "$recordings/claude-code-messages.json" "$port" <<'PY'
import json, sys, time

import httpx

recording, port = json.load(open(sys.argv[1])), sys.argv[2]
headers = {k: v for k, v in recording["headers"].items() if k.lower() != "content-type"}
body = recording["body"] | {"max_tokens": 64, "stream": False}
for turn in ("first", "second"):
    started = time.time()
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/messages", json=body, headers=headers, timeout=3600).json()
    if "usage" not in reply:
        print(f"recorded Claude Code request, {turn}: refused: {reply}")
        break
    cached, new = reply["usage"]["cache_read_input_tokens"], reply["usage"]["input_tokens"]
    print(f"recorded Claude Code request, {turn}: {time.time() - started:.1f} s, {cached + new} prompt tokens,"
          f" {cached} from the cache, stop {reply['stop_reason']}")
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=00001;"}
    answer = reply["content"] or [{"type": "text", "text": "Done."}]
    turns = [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now list the files here."}]
    body = body | {"system": [billing, *body["system"][1:]], "messages": [*body["messages"], *turns]}
PY
fi

# run NAME COMMAND...: the client in its own folder with a buggy calc.py; one line on how it went
run() {
  local name=$1 started=$SECONDS status
  shift
  mkdir -p "$work/$name"
  printf 'def add(a, b):\n    return a - b\n' >"$work/$name/calc.py"
  (cd "$work/$name" && timeout 1800 "$@" -- "$task" </dev/null >"$work/$name.out" 2>&1)
  status=$?
  local fixed="calc.py not fixed"
  grep -q "a + b" "$work/$name/calc.py" && fixed="calc.py fixed"
  if [ $status -eq 0 ] && [ "$fixed" = "calc.py fixed" ]; then
    echo "$name: completed in $((SECONDS - started)) s ($fixed)"
  else
    echo "$name: did not complete in $((SECONDS - started)) s (exit $status, $fixed); its last words:"
    tail -5 "$work/$name.out" | sed 's/^/  /'
  fi
}

ANTHROPIC_BASE_URL=http://127.0.0.1:$port ANTHROPIC_API_KEY=unused \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 API_TIMEOUT_MS=1800000 \
  CLAUDE_CODE_MAX_OUTPUT_TOKENS=1024 \
  run claude claude -p --tools Read,Edit,Write --allowedTools Read,Edit,Write --permission-mode acceptEdits
run codex codex exec -m edgespec -c model_provider=edgespec -c model_providers.edgespec.name=edgespec \
  -c model_providers.edgespec.base_url=http://127.0.0.1:$port/v1 -c model_providers.edgespec.wire_api=responses \
  --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox
echo "the server's answers:"
grep -E "answered|WARNING" "$work/serve.log" | sed 's/^/  /'
