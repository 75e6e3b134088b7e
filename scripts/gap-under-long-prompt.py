#!/usr/bin/env python3
"""One client streams while a long prompt arrives on the same instance: the stream's
inter-token gaps (median, worst) and the long prompt's time to its first token.

    scripts/gap-under-long-prompt.py [--node 127.0.0.1:52415] [--words 4000] [--tokens 600]
                                     [--alone] [--worst N]

`--alone` first streams the same answer with no long prompt beside it: the floor the
machine itself sets (a stream's steps alone vary, and so does their delivery).

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


def summary(times):
    """The gaps between a stream's pieces: median, 99th percentile, worst."""
    gaps = sorted((b - a) * 1e3 for a, b in zip(times, times[1:]))
    median, p99 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.99)]
    return (
        f"{len(times)} pieces, median gap {median:.1f} ms, p99 {p99:.1f} ms ({p99 / median:.2f}x), "
        f"worst {gaps[-1]:.1f} ms ({gaps[-1] / median:.2f}x the median)"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default="127.0.0.1:52415")
    ap.add_argument("--words", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--worst", type=int, default=0, help="also list the N worst gaps and when they came")
    ap.add_argument("--alone", action="store_true", help="first the same stream with nothing beside it")
    a = ap.parse_args()
    story = {"prompt": "Write a long story about a dragon.", "max_tokens": a.tokens}
    if a.alone:
        alone = []
        stream(a.node, story, alone)
        print(f"alone:  {summary(alone[0])}")
    streamed, long = [], []
    s = threading.Thread(
        target=stream,
        args=(a.node, story, streamed),
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
    ttft = (long[0][0] - sent) * 1e3 if long[0] else float("nan")
    if a.worst:
        ranked = sorted(((b - a_) * 1e3, a_ - sent) for a_, b in zip(times, times[1:]))[::-1]
        for gap, at in ranked[: a.worst]:
            print(f"  gap {gap:.1f} ms from {at * 1e3:+.0f} ms after the long prompt was sent ({time.strftime('%H:%M:%S', time.gmtime(sent + at))}.{int((sent + at) % 1 * 1000):03d} UTC)")
    print(f"stream: {summary(times)}; the long prompt's first token after {ttft:.0f} ms")


if __name__ == "__main__":
    main()
