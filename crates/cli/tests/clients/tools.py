"""Tool calling through the three official clients against a node serving a model whose
chat template takes tools (qwen2.5-coder-0.5b): the model's call comes back as OpenAI
`tool_calls`, Anthropic `tool_use` blocks and Ollama `tool_calls`, streamed and not, and
a conversation carrying the call and its result is answered. Run by
crates/cli/tests/clients.rs inside a host of the testbed:

    python3 tools.py HOST_URL MODEL
"""
import json
import sys

import anthropic
import ollama
import openai

host, model = sys.argv[1], sys.argv[2]


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        sys.exit(1)


schema = {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
          "required": ["city"]}
description = "Get the current weather in a city"
question = "What is the weather like in Paris right now?"
result = json.dumps({"temperature_c": 18, "sky": "sunny"})


def paris(arguments):
    return isinstance(arguments, dict) and "paris" in str(arguments.get("city", "")).lower()


# OpenAI
oa = openai.OpenAI(base_url=host + "/v1", api_key="unused", max_retries=0, timeout=120)
tools = [{"type": "function", "function": {"name": "get_weather", "description": description,
                                           "parameters": schema}}]
asked = [{"role": "user", "content": question}]
r = oa.chat.completions.create(model=model, messages=asked, tools=tools, temperature=0, max_tokens=64)
c = r.choices[0]
calls = c.message.tool_calls or []
check("openai: the model's call is a tool call", c.finish_reason == "tool_calls" and len(calls) == 1
      and calls[0].function.name == "get_weather" and paris(json.loads(calls[0].function.arguments)),
      c)
check("openai: a call's id and no content", calls[0].id and not c.message.content, c.message)

deltas = []
finish = None
for chunk in oa.chat.completions.create(model=model, messages=asked, tools=tools, temperature=0,
                                        max_tokens=64, stream=True):
    if chunk.choices:
        deltas.extend(chunk.choices[0].delta.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
check("openai: the streamed call is a delta with the same call", finish == "tool_calls"
      and len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id
      and deltas[0].function.name == "get_weather"
      and deltas[0].function.arguments == calls[0].function.arguments, (finish, deltas))

followed = asked + [c.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": calls[0].id, "content": result}]
r = oa.chat.completions.create(model=model, messages=followed, tools=tools, temperature=0,
                               max_tokens=32)
check("openai: the call and its result are taken back", r.choices[0].finish_reason in
      ("stop", "length", "tool_calls") and r.usage.prompt_tokens > r.usage.completion_tokens, r)

r = oa.chat.completions.create(model=model, messages=asked, tools=tools, tool_choice="none",
                               temperature=0, max_tokens=16)
check("openai: tool_choice none shows no tools", not r.choices[0].message.tool_calls, r)

# Anthropic
an = anthropic.Anthropic(base_url=host, api_key="unused", max_retries=0, timeout=120)
atools = [{"name": "get_weather", "description": description, "input_schema": schema}]
m = an.messages.create(model=model, max_tokens=64, tools=atools,
                       messages=[{"role": "user", "content": question}], extra_body={"temperature": 0})
uses = [b for b in m.content if b.type == "tool_use"]
check("anthropic: the model's call is a tool_use block", m.stop_reason == "tool_use"
      and len(uses) == 1 and uses[0].name == "get_weather" and paris(uses[0].input), m)

with an.messages.stream(model=model, max_tokens=64, tools=atools,
                        messages=[{"role": "user", "content": question}],
                        extra_body={"temperature": 0}) as stream:
    final = stream.get_final_message()
streamed = [b for b in final.content if b.type == "tool_use"]
check("anthropic: the streamed tool_use has the same input", final.stop_reason == "tool_use"
      and len(streamed) == 1 and streamed[0].input == uses[0].input, final)

m2 = an.messages.create(model=model, max_tokens=32, tools=atools, extra_body={"temperature": 0},
                        messages=[{"role": "user", "content": question},
                                  {"role": "assistant", "content": m.content},
                                  {"role": "user", "content": [{"type": "tool_result",
                                                                "tool_use_id": uses[0].id,
                                                                "content": result}]}])
check("anthropic: tool_use and tool_result are taken back",
      m2.usage.input_tokens + (m2.usage.cache_read_input_tokens or 0) > 50, m2.usage)

# Ollama
ol = ollama.Client(host=host, timeout=120)
o = ol.chat(model=model, messages=[{"role": "user", "content": question}], tools=tools,
            options={"temperature": 0, "num_predict": 64})
ocalls = o.message.tool_calls or []
check("ollama: the model's call is in tool_calls", len(ocalls) == 1
      and ocalls[0].function.name == "get_weather" and paris(dict(ocalls[0].function.arguments)), o)
streamed = []
for part in ol.chat(model=model, messages=[{"role": "user", "content": question}], tools=tools,
                    options={"temperature": 0, "num_predict": 64}, stream=True):
    streamed.extend(part.message.tool_calls or [])
check("ollama: the streamed answer carries the same call", len(streamed) == 1
      and dict(streamed[0].function.arguments) == dict(ocalls[0].function.arguments), streamed)
o2 = ol.chat(model=model, tools=tools, options={"temperature": 0, "num_predict": 32},
             messages=[{"role": "user", "content": question}, o.message,
                       {"role": "tool", "content": result, "tool_name": "get_weather"}])
check("ollama: the call and its result are taken back", o2.done and o2.prompt_eval_count > 50, o2)
print("all checks passed")
