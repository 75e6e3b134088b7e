#!/usr/bin/env python3
"""Independent reference for shoal's correctness tests.

A plain numpy f32 forward pass over the tensors of a GGUF file, dequantized by the `gguf`
Python package (llama.cpp's own gguf-py), with chat templates rendered by jinja2 (as
Hugging Face does) and token ids from llama.cpp's `llama-tokenize`. Nothing here shares
code with shoal. It writes a JSON fixture with, for each chat prompt, the prompt ids, 32
greedy ids and the gap between the top two logits at each step, and for a text, the
teacher-forced arg-max ids, top-two gaps and the perplexity.

    python3 tools/reference/reference.py --model M.gguf --name smollm2-135m \
        --llama-tokenize ~/.cache/llamacpp-anchor/build/bin/llama-tokenize \
        --prompts tests/fixtures/chat_prompts.json --text tests/fixtures/prose.txt \
        --out tests/fixtures/reference-smollm2-135m.json
"""
import argparse
import hashlib
import json
import subprocess

import jinja2
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(v).decode("utf-8")
    return v.tolist()[0] if hasattr(v, "tolist") else v


class Model:
    def __init__(self, path):
        r = GGUFReader(path)
        self.arch = field(r, "general.architecture")
        a = self.arch
        self.n_layer = field(r, f"{a}.block_count")
        self.n_embd = field(r, f"{a}.embedding_length")
        self.n_head = field(r, f"{a}.attention.head_count")
        self.n_kv = field(r, f"{a}.attention.head_count_kv", self.n_head)
        self.head_dim = field(r, f"{a}.attention.key_length", self.n_embd // self.n_head)
        self.eps = field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
        self.theta = field(r, f"{a}.rope.freq_base", 10000.0)
        self.template = field(r, "tokenizer.chat_template")
        tokens_field = r.fields["tokenizer.ggml.tokens"]
        self.tokens = [bytes(tokens_field.parts[i]).decode("utf-8") for i in tokens_field.data]
        bos = field(r, "tokenizer.ggml.bos_token_id")
        eos = field(r, "tokenizer.ggml.eos_token_id")
        self.bos_text = self.tokens[bos] if bos is not None else ""
        self.eos_text = self.tokens[eos] if eos is not None else ""
        self.w = {}
        for t in r.tensors:
            ne = [int(x) for x in t.shape]
            arr = dequantize(t.data, t.tensor_type).astype(np.float32)
            self.w[t.name] = arr.reshape(list(reversed(ne)))
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]
        half = self.head_dim // 2
        self.inv_freq = 1.0 / (self.theta ** (np.arange(half, dtype=np.float64) * 2 / self.head_dim))

    def rms(self, x, w):
        return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + self.eps)).astype(np.float32) * w

    def rope(self, x, pos):
        # x: (t, heads, hd); llama GGUF rotates adjacent pairs, qwen rotates halves.
        ang = np.outer(pos, self.inv_freq)
        cos = np.cos(ang)[:, None, :].astype(np.float32)
        sin = np.sin(ang)[:, None, :].astype(np.float32)
        if self.arch == "llama":
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2] = a * cos - b * sin
            out[..., 1::2] = a * sin + b * cos
            return out
        h = self.head_dim // 2
        a, b = x[..., :h], x[..., h:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def linear(self, x, name):
        y = x @ self.w[name + ".weight"].T
        if name + ".bias" in self.w:
            y = y + self.w[name + ".bias"]
        return y

    def forward(self, ids, cache):
        """Logits (t, vocab) for `ids` following the positions already in `cache`."""
        start = cache["len"]
        t = len(ids)
        pos = np.arange(start, start + t)
        x = self.w["token_embd.weight"][ids]
        hd, nh, nkv = self.head_dim, self.n_head, self.n_kv
        for i in range(self.n_layer):
            p = f"blk.{i}"
            h = self.rms(x, self.w[p + ".attn_norm.weight"])
            q = self.linear(h, p + ".attn_q").reshape(t, nh, hd)
            k = self.linear(h, p + ".attn_k").reshape(t, nkv, hd)
            v = self.linear(h, p + ".attn_v").reshape(t, nkv, hd)
            if p + ".attn_q_norm.weight" in self.w:
                q = self.rms(q, self.w[p + ".attn_q_norm.weight"])
                k = self.rms(k, self.w[p + ".attn_k_norm.weight"])
            q, k = self.rope(q, pos), self.rope(k, pos)
            ks, vs = cache.setdefault(i, ([], []))
            ks.append(k)
            vs.append(v)
            K, V = np.concatenate(ks), np.concatenate(vs)  # (s, nkv, hd)
            s = K.shape[0]
            out = np.empty((t, nh, hd), dtype=np.float32)
            mask = np.arange(s)[None, :] > pos[:, None]
            for hh in range(nh):
                kv = hh // (nh // nkv)
                sc = (q[:, hh, :] @ K[:, kv, :].T) / np.sqrt(hd)
                sc = np.where(mask, -np.inf, sc)
                sc = sc - sc.max(axis=-1, keepdims=True)
                pr = np.exp(sc)
                pr /= pr.sum(axis=-1, keepdims=True)
                out[:, hh, :] = pr @ V[:, kv, :]
            x = x + self.linear(out.reshape(t, nh * hd), p + ".attn_output")
            h = self.rms(x, self.w[p + ".ffn_norm.weight"])
            g = self.linear(h, p + ".ffn_gate")
            u = self.linear(h, p + ".ffn_up")
            x = x + self.linear((g / (1 + np.exp(-g))) * u, p + ".ffn_down")
        cache["len"] = start + t
        h = self.rms(x, self.w["output_norm.weight"])
        return h @ self.w["output.weight"].T


def gap(row):
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def tokenize(binary, model_path, text, bos):
    args = [binary, "-m", model_path, "-p", text, "--ids", "--log-disable"]
    if not bos:
        args.append("--no-bos")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--llama-tokenize", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    m = Model(a.model)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(m.template)
    result = {"model": a.name, "sha256": hashlib.sha256(open(a.model, "rb").read()).hexdigest(),
              "chat": [], "perplexity": {}}
    for prompt in json.load(open(a.prompts)):
        rendered = tmpl.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                               bos_token=m.bos_text, eos_token=m.eos_text)
        ids = tokenize(a.llama_tokenize, a.model, rendered, bos=False)
        cache = {"len": 0}
        logits = m.forward(np.array(ids), cache)[-1]
        greedy, gaps = [], []
        for _ in range(a.steps):
            nxt = int(np.argmax(logits))
            greedy.append(nxt)
            gaps.append(gap(logits))
            logits = m.forward(np.array([nxt]), cache)[-1]
        result["chat"].append({"prompt": prompt, "rendered": rendered, "prompt_ids": ids,
                               "greedy": greedy, "gaps": gaps})
        print(prompt, "->", greedy[:8], flush=True)
    text = open(a.text).read()
    ids = tokenize(a.llama_tokenize, a.model, text, bos=True)
    logits = m.forward(np.array(ids), {"len": 0})
    z = logits - logits.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z.astype(np.float64)).sum(axis=-1, keepdims=True))
    nll = [-float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    result["perplexity"] = {
        "tokens": ids,
        "top1": [int(x) for x in np.argmax(logits[:-1], axis=-1)],
        "gaps": [gap(row) for row in logits[:-1]],
        "ppl": float(np.exp(np.mean(nll))),
    }
    print("perplexity", result["perplexity"]["ppl"], "over", len(ids), "tokens")
    json.dump(result, open(a.out, "w"))


if __name__ == "__main__":
    main()
