#!/usr/bin/env python3
"""Two models on one node: model B's time to first token on a short prompt, idle and
while model A prefills a long prompt with a second request of A queued behind it.

    python3 scripts/two-models-ttft.py --node http://127.0.0.1:52415 \
        --a qwen2.5-coder-0.5b --b smollm2-135m [--prompt-tokens 4000] [--runs 5]

Both models must have a ready instance on the node. Prints B's idle figures, B's figures
during A's prefill (each checked against the node's status: A was still prefilling when
B's first token came), and the ratio of the medians. Uses the official `openai` client.
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

import openai


def status(node):
    with urllib.request.urlopen(node + "/v1/status", timeout=10) as r:
        return json.load(r)


def prefilling(node, model):
    s = status(node)
    ids = {i["id"] for i in s["instances"] if i["model"] == model}
    return sum(x["prefilling"] for x in s.get("serving", []) if x["instance"] in ids)


def ttft(client, model, prompt, max_tokens=8):
    t = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(model=model, max_tokens=max_tokens,
                                                temperature=0, stream=True,
                                                messages=[{"role": "user", "content": prompt}]):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t
    return first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default="http://127.0.0.1:52415")
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.node + "/v1", api_key="unused", max_retries=0, timeout=600)
    # A different short question each time: the prefix cache may hold the template's
    # system text, never the whole prompt.
    names = iter(["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy", "Jo", "Kit", "Lu",
                  "Mo", "Ned", "Oz", "Pia", "Quin", "Rex", "Sol", "Tam", "Uma", "Vic"])
    short = lambda: f"Say hi to {next(names)} in three words."
    ttft(client, args.b, short())  # warm
    idle = [ttft(client, args.b, short()) for _ in range(args.runs)]
    # Unique from its first word: nothing of it is in the prefix cache.
    long_prompt = f"{time.time_ns()} " + "word " * args.prompt_tokens
    a_times = []

    def ask_a(i):
        t = time.perf_counter()
        ttft(client, args.a, long_prompt + str(i), max_tokens=4)
        a_times.append(time.perf_counter() - t)

    threads = [threading.Thread(target=ask_a, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
        time.sleep(0.2)
    deadline = time.time() + 60
    while prefilling(args.node, args.a) == 0:
        if time.time() > deadline:
            raise SystemExit("A never started prefilling")
        time.sleep(0.1)
    loaded, during = [], []
    for _ in range(args.runs):
        t = ttft(client, args.b, short())
        still = prefilling(args.node, args.a) > 0
        loaded.append(t)
        during.append(still)
        if not still:
            break
    for th in threads:
        th.join()
    m_idle, m_load = statistics.median(idle), statistics.median(loaded)
    print(json.dumps({
        "b_idle_s": [round(x, 3) for x in idle],
        "b_during_a_prefill_s": [round(x, 3) for x in loaded],
        "a_still_prefilling_after_each": during,
        "a_answer_s": [round(x, 1) for x in a_times],
        "median_idle_s": round(m_idle, 3),
        "median_during_s": round(m_load, 3),
        "ratio": round(m_load / m_idle, 2),
    }, indent=1))


if __name__ == "__main__":
    main()
