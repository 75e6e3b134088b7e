#!/usr/bin/env python3
"""Total generation tokens/s of an OpenAI-compatible server under N concurrent clients.

    scripts/serving-curve.py --url http://127.0.0.1:8080/v1 --model M [--concurrency 1,2,4,8,16,32]
                             [--tokens 64] [--repeat 2] [--json]

Each client sends --repeat streaming chat requests one after another (a short question,
distinct per client and request, temperature 0, --tokens answer tokens). Per level: the
completion tokens over the wall time, and time to first token / gaps between chunks
(p50, p99). Used for llama.cpp's `llama-server -np N` beside `shoal bench --node` (the
same prompts, see crates/cli/src/bench_node.rs), and for shoal's own OpenAI API.
"""
import argparse
import json
import threading
import time

import openai


def one(client, model, tokens, c, n):
    prompt = f"Tell me a long story about a lighthouse, number {c}-{n}."
    start = time.perf_counter()
    times = []
    usage = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    completion = usage.completion_tokens if usage else len(times)
    return start, times, completion


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def level(url, key, model, clients, tokens, repeat):
    results = []
    lock = threading.Lock()

    def run(c):
        client = openai.OpenAI(base_url=url, api_key=key, timeout=600)
        for n in range(repeat):
            r = one(client, model, tokens, c, n)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    total = sum(r[2] for r in results)
    ttft = [(r[1][0] - r[0]) * 1e3 for r in results if r[1]]
    gaps = [(b - a) * 1e3 for r in results for a, b in zip(r[1], r[1][1:])]
    return {
        "clients": clients,
        "requests": len(results),
        "total_tok_s": total / wall,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(gaps, 50),
        "itl_p99_ms": pct(gaps, 99),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--key", default="none")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    # A warm-up request first (weights paged in, caches built).
    one(openai.OpenAI(base_url=a.url, api_key=a.key), a.model, 8, 999, 0)
    rows = [level(a.url, a.key, a.model, int(c), a.tokens, a.repeat) for c in a.concurrency.split(",")]
    if a.json:
        print(json.dumps(rows))
        return
    print("| clients | requests | total tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['clients']} | {r['requests']} | {r['total_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
