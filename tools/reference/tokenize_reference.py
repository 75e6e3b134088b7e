#!/usr/bin/env python3
"""Reference token ids for shoal's tokenizer tests, from llama.cpp's `llama-tokenize`.

    python3 tools/reference/tokenize_reference.py LLAMA_TOKENIZE MODEL.gguf \
        tests/fixtures/tokenizer_texts.json tests/fixtures/tokenizer-NAME.json

Each text is passed through a file, verbatim (special tokens parsed, no BOS).
"""
import json
import subprocess
import sys
import tempfile

binary, model, texts_path, out_path = sys.argv[1:5]
cases = []
for text in json.load(open(texts_path)):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(text)
        name = f.name
    out = subprocess.run([binary, "-m", model, "-f", name, "--ids", "--no-bos", "--log-disable"],
                         check=True, capture_output=True, text=True).stdout
    cases.append({"text": text, "ids": json.loads(out.strip().splitlines()[-1])})
json.dump(cases, open(out_path, "w"), ensure_ascii=False, indent=0)
print(len(cases), "cases written to", out_path)
