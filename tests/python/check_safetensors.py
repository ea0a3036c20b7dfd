"""A checkpoint's every part and its export, read with the safetensors package (what Python
users open them with; tests/check_hf.sh).

    check_safetensors.py CHECKPOINT INSPECT_LOG EXPORT

Every part opens, its metadata is text, every tensor reads; the export holds what
`dtrain inspect` lists (names, shapes, dtypes), replicated tensors equal to each part's
copy and split ones as many values as their parts together.
"""
import glob
import os
import re
import sys

from safetensors import safe_open

DTYPES = {"float32": "Float", "float16": "Half", "bfloat16": "BFloat16", "float64": "Double",
          "int64": "Long", "int32": "Int", "uint8": "Byte", "bool": "Bool"}


def read(path):
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            sys.exit(f"check_safetensors: {path}: metadata is not text: {meta}")
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def listed(inspect_log):
    # inspect's "model (N tensors, M values):" section: "  NAME  [SHAPE]  DTYPE" lines.
    out, inside = {}, False
    for line in open(inspect_log):
        if line.startswith("model ("):
            inside = True
        elif inside and not line.startswith("  "):
            break
        elif inside:
            m = re.match(r"\s+(\S+)\s+\[([0-9, ]*)\]\s+(\S+)", line)
            out[m.group(1)] = ([int(x) for x in m.group(2).split(",") if x.strip()], m.group(3))
    return out


def main(checkpoint, inspect_log, export):
    parts = sorted(glob.glob(os.path.join(checkpoint, "*.safetensors")))
    if not parts:
        sys.exit(f"check_safetensors: no parts in {checkpoint}")
    read_parts = {os.path.basename(p): read(p)[0] for p in parts}
    exported, _ = read(export)
    want = listed(inspect_log)
    if set(want) != set(exported):
        sys.exit(f"check_safetensors: export and inspect differ: {sorted(set(want) ^ set(exported))[:5]}")
    for name, (shape, dtype) in want.items():
        t = exported[name]
        if list(t.shape) != shape or DTYPES.get(str(t.dtype).replace("torch.", "")) != dtype:
            sys.exit(f"check_safetensors: {name}: {list(t.shape)} {t.dtype} exported, {shape} {dtype} inspected")
    numel = {}
    for file, tensors in read_parts.items():
        if not file.startswith("model."):
            continue
        for name, t in tensors.items():
            if list(t.shape) == list(exported[name].shape):
                if not t.equal(exported[name]):
                    sys.exit(f"check_safetensors: {file} {name} differs from the export")
            else:
                numel[name] = numel.get(name, 0) + t.numel()
    for name, n in numel.items():
        if n != exported[name].numel():
            sys.exit(f"check_safetensors: {name}: the parts hold {n} values, the export {exported[name].numel()}")
    print(f"check_safetensors: {len(parts)} parts, {len(exported)} exported tensors ({len(numel)} split)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
