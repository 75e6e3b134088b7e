#!/usr/bin/env python3
"""One client streams while a long prompt arrives on the same instance: the stream's
inter-token gaps (median, worst) and the long prompt's time to its first token.

    scripts/gap-under-long-prompt.py [--node 127.0.0.1:52415] [--words 4000] [--tokens 600]

Needs a node with a ready instance whose context holds the long prompt (`shoal place
MODEL --ctx 8192`). The long prompt is random words, so no kept prefix serves it.
"""
import argparse
import http.client
import json
import random
import threading
import time

WORDS = "apple river stone cloud music paper garden window silver forest ocean candle mirror engine planet".split()


def stream(node, body, out):
    host, port = node.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=600)
    c.request("POST", "/v1/run", json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"the node answered {r.status}: {r.read()[:200]!r}")
    times = []
    for line in r:
        line = line.strip()
        if not line:
            continue
        v = json.loads(line)
        if "error" in v:
            raise SystemExit(f"the answer failed: {v['error']}")
        if "text" in v:
            times.append(time.time())
        if v.get("done"):
            break
    out.append(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default="127.0.0.1:52415")
    ap.add_argument("--words", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=600)
    a = ap.parse_args()
    streamed, long = [], []
    s = threading.Thread(
        target=stream,
        args=(a.node, {"prompt": "Write a long story about a dragon.", "max_tokens": a.tokens}, streamed),
    )
    s.start()
    time.sleep(2.0)
    sent = time.time()
    prompt = " ".join(random.choice(WORDS) for _ in range(a.words)) + " Summarize."
    lt = threading.Thread(
        target=stream, args=(a.node, {"prompt": prompt, "raw": True, "max_tokens": 4}, long)
    )
    lt.start()
    lt.join()
    s.join()
    times = streamed[0]
    gaps = sorted((b - a) * 1e3 for a, b in zip(times, times[1:]))
    median = gaps[len(gaps) // 2]
    ttft = (long[0][0] - sent) * 1e3 if long[0] else float("nan")
    print(
        f"stream: {len(times)} pieces, median gap {median:.1f} ms, worst {gaps[-1]:.1f} ms "
        f"({gaps[-1] / median:.2f}x the median); the long prompt's first token after {ttft:.0f} ms"
    )


if __name__ == "__main__":
    main()
