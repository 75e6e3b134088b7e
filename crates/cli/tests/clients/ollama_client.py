"""The official `ollama` client against a node: chat and generate (streamed and not),
tags, version, and bad requests answered with Ollama's error while the instance keeps
serving. Run by crates/cli/tests/clients.rs inside a host of the testbed:

    python3 ollama_client.py HOST_URL MODEL
"""
import sys

import ollama

host, model = sys.argv[1], sys.argv[2]
client = ollama.Client(host=host, timeout=120)


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


names = [m.model for m in client.list().models]
check("tags list the model", model in names, names)
question = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
greedy = {"temperature": 0, "num_predict": 24}
r = client.chat(model=model, messages=question, options=greedy, stream=False)
whole = r.message.content
check("chat answers", "Paris" in whole, repr(whole))
check("chat's last object says why and how long", r.done and r.done_reason in ("stop", "length")
      and r.eval_count > 0 and r.prompt_eval_count > 5 and r.total_duration > 0, r)
pieces, last = [], None
for part in client.chat(model=model, messages=question, options=greedy, stream=True):
    pieces.append(part.message.content)
    last = part
check("a streamed chat equals the whole one (greedy)", "".join(pieces) == whole, repr("".join(pieces)))
check("the stream ends with done and the counts", last.done and last.eval_count == r.eval_count, last)
g = client.generate(model=model, prompt="The capital of France is", raw=True,
                    options={"temperature": 0, "num_predict": 4}, stream=False)
check("generate continues raw text", "Paris" in g.response and g.done_reason == "length", g)
shown = client.show(model)
check("show describes the model", shown.details.format == "gguf" and shown.details.family
      and "completion" in (shown.capabilities or []) and shown.modelinfo, shown)
running = client.ps()
check("ps lists the model served", any(m.model == model for m in running.models), running)
try:
    client.show("no-such-model")
    check("show of an unknown model", False, "accepted")
except ollama.ResponseError as e:
    check("show of an unknown model: 404", e.status_code == 404, e)

for what, kwargs in [
    ("an unknown model", dict(model="no-such-model", messages=question)),
    ("a prompt past the context", dict(model=model, messages=[{"role": "user", "content": "word " * 20000}])),
    ("an oversized body", dict(model=model, messages=[{"role": "user", "content": "x" * (9 << 20)}])),
]:
    try:
        client.chat(stream=False, **kwargs)
        check(what, False, "accepted")
    except ollama.ResponseError as e:
        check(f"{what}: {e.status_code}", e.status_code in (400, 404, 413) and e.error,
              (e.status_code, e.error[:200]))
r2 = client.chat(model=model, messages=question, options=greedy, stream=False)
check("the instance still serves", r2.message.content == whole)
print("all checks passed")
