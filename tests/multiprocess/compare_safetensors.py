#!/usr/bin/env python3
"""An independent safetensors reader (the standard library only) for the merge-weights test.

compare_safetensors.py MERGED REFERENCE [--bf16]
Each argument is a directory holding model.safetensors or model.safetensors.index.json with its shards.
Prints one JSON line: the tensors compared, and those that differ. Without --bf16 every tensor must be
bit for bit equal; with it MERGED holds bf16 and each value must be REFERENCE's fp32 rounded to nearest even.
"""
import json
import os
import struct
import sys


def read_dir(path):
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    tensors = {}
    for name in files:
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            tensors[key] = (entry["dtype"], tuple(entry["shape"]), data[8 + n + begin : 8 + n + end])
    return tensors, len(files)


def bf16_of(fp32_bytes):
    words = struct.unpack("<%dI" % (len(fp32_bytes) // 4), fp32_bytes)
    rounded = [((w + 0x7FFF + ((w >> 16) & 1)) >> 16) & 0xFFFF for w in words]
    return struct.pack("<%dH" % len(rounded), *rounded)


def main():
    merged, files = read_dir(sys.argv[1])
    reference, _ = read_dir(sys.argv[2])
    bf16 = "--bf16" in sys.argv
    differ = []
    for key, (dtype, shape, raw) in reference.items():
        if key not in merged:
            differ.append(key + " (missing)")
            continue
        got_dtype, got_shape, got = merged[key]
        want = bf16_of(raw) if bf16 and dtype == "F32" else raw
        want_dtype = "BF16" if bf16 and dtype == "F32" else dtype
        if got_dtype != want_dtype or got_shape != shape or got != want:
            differ.append(key)
    extra = sorted(set(merged) - set(reference))
    print(json.dumps({"compared": len(reference), "files": files, "differ": differ, "extra": extra}))


if __name__ == "__main__":
    main()
