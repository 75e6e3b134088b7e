"""The official `openai` client against a node: chat (streamed and not), completions,
models, and bad requests answered with OpenAI's error shape while the instance keeps
serving. Run by crates/cli/tests/openai.rs inside a host of the testbed:

    python3 openai_client.py BASE_URL MODEL
"""
import json
import sys
import urllib.error
import urllib.request

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


ids = [m.id for m in client.models.list().data]
check("models lists the model", model in ids, ids)

question = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
r = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
whole = r.choices[0].message.content
check("chat answers", "Paris" in whole, repr(whole))
check("chat says why it ended", r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
check("chat counts tokens", r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
      and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage)

stream = client.chat.completions.create(
    model=model, messages=question, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
pieces, finish, usage, roles = [], None, None, []
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.role:
            roles.append(c.delta.role)
        if c.delta.content:
            pieces.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
check("a streamed chat equals the whole one (greedy)", "".join(pieces) == whole, repr("".join(pieces)))
check("the stream starts with the assistant's role", roles == ["assistant"], roles)
check("the stream ends with a finish reason and the usage", finish is not None and usage is not None
      and usage.completion_tokens == r.usage.completion_tokens, (finish, usage))

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
check("completions continue raw text", "Paris" in r.choices[0].text, repr(r.choices[0].text))
check("completions stop at max_tokens", r.usage.completion_tokens <= 4 and r.choices[0].finish_reason == "length",
      (r.usage, r.choices[0].finish_reason))


r = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0,
                                   frequency_penalty=1.5, presence_penalty=0.5)
check("penalties are taken", r.choices[0].message.content and r.usage.completion_tokens > 0, r)


def refused(status, what, **kwargs):
    try:
        client.chat.completions.create(**kwargs)
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(f"{what}: {status}", e.status_code == status and "message" in body, (e.status_code, e.body))
        return
    check(f"{what}: {status}", False, "accepted")


hello = [{"role": "user", "content": "Hello"}]
refused(404, "an unknown model", model="no-such-model", messages=hello)
refused(400, "n > 1", model=model, messages=hello, n=2)
refused(400, "a penalty out of range", model=model, messages=hello, presence_penalty=3)
refused(400, "tools on a model whose template takes none", model=model, messages=hello,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
refused(400, "a prompt past the context", model=model, messages=[{"role": "user", "content": "word " * 20000}])
refused(400, "a wrong type", model=model, messages=hello, max_tokens="x")
refused(400, "max_tokens past the context", model=model, messages=hello, max_tokens=1_000_000)
refused(413, "an oversized body", model=model, messages=[{"role": "user", "content": "x" * (9 << 20)}])


def raw(body, what):
    req = urllib.request.Request(base + "/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=30)
        check(what, False, "accepted")
    except urllib.error.HTTPError as e:
        err = json.loads(e.read())
        check(what + ": 400", e.code == 400 and "message" in err.get("error", {}), (e.code, err))


raw(b"{not json", "malformed JSON")
raw(json.dumps({"model": model, "messages": hello, "best_of": 3}).encode(), "an unknown field")

r = client.chat.completions.create(model=model, messages=question, max_tokens=24, temperature=0)
check("the instance still serves after the bad requests", r.choices[0].message.content == whole)
print("all checks passed")
