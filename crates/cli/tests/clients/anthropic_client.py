"""The official `anthropic` client against a node: messages streamed and not, the usage,
and bad requests in Anthropic's error shape while the instance keeps serving. Run by
crates/cli/tests/openai.rs inside a host of the testbed:

    python3 anthropic_client.py BASE_URL MODEL
"""
import sys

import anthropic

base, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


question = [{"role": "user", "content": "What is the capital of France?"}]
m = client.messages.create(model=model, max_tokens=24, system="Answer in one short sentence.",
                           messages=question, extra_body={"temperature": 0})
whole = "".join(b.text for b in m.content if b.type == "text")
check("messages answer", "Paris" in whole, repr(whole))
check("messages say why they ended", m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason)
check("messages count tokens", m.usage.input_tokens > 5 and m.usage.output_tokens > 0, m.usage)

with client.messages.stream(model=model, max_tokens=24, system="Answer in one short sentence.",
                            messages=question, extra_body={"temperature": 0}) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
check("a streamed message equals the whole one (greedy)", streamed == whole, repr(streamed))
check("the stream's final message has the usage and stop reason",
      final.usage.output_tokens == m.usage.output_tokens and final.stop_reason == m.stop_reason,
      (final.usage, final.stop_reason))

n = client.messages.count_tokens(model=model, system="Answer in one short sentence.", messages=question)
check("count_tokens counts what the message would read", n.input_tokens == m.usage.input_tokens
      + (m.usage.cache_read_input_tokens or 0), (n, m.usage))

for what, status, kwargs in [
    ("an unknown model", 404, dict(model="no-such-model", max_tokens=5, messages=question)),
    ("tools on a model whose template takes none", 400, dict(model=model, max_tokens=5, messages=question,
                                  tools=[{"name": "f", "input_schema": {"type": "object"}}])),
    ("max_tokens past the context", 400, dict(model=model, max_tokens=1_000_000, messages=question)),
    ("an oversized body", 413, dict(model=model, max_tokens=5,
                                    messages=[{"role": "user", "content": "x" * (9 << 20)}])),
    ("a prompt past the context", 400, dict(model=model, max_tokens=5,
                                            messages=[{"role": "user", "content": "word " * 20000}])),
]:
    try:
        client.messages.create(**kwargs)
        check(what, False, "accepted")
    except anthropic.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        check(f"{what}: {status}", e.status_code == status and body.get("type") == "error"
              and "message" in body.get("error", {}), (e.status_code, e.body))

m = client.messages.create(model=model, max_tokens=24, system="Answer in one short sentence.",
                           messages=question, extra_body={"temperature": 0})
check("the instance still serves", "".join(b.text for b in m.content) == whole)
print("all checks passed")
