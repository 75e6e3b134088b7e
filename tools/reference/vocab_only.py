#!/usr/bin/env python3
"""Writes a GGUF holding only the tokenizer metadata of another (no tensors): the
fixtures of the tokenizer tests.  python3 vocab_only.py MODEL.gguf OUT.gguf"""
import sys
from gguf import GGUFReader, GGUFWriter, GGUFValueType
src, dst = sys.argv[1], sys.argv[2]
r = GGUFReader(src)
arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
w = GGUFWriter(dst, arch)
for k, f in r.fields.items():
    if not k.startswith("tokenizer."):
        continue
    t = f.types[0]
    if t == GGUFValueType.ARRAY:
        sub = f.types[1]
        if sub == GGUFValueType.STRING:
            vals = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_array(k, vals)
    elif t == GGUFValueType.STRING:
        w.add_string(k, bytes(f.parts[f.data[0]]).decode("utf-8"))
    else:
        w.add_key_value(k, f.parts[f.data[0]].tolist()[0], t)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
