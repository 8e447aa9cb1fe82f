#!/usr/bin/env bash
# The wheels that a bare GPU image (torch, triton, numpy, pytest, transformers, tokenizers, safetensors and
# pyarrow installed; nothing reachable) lacks for benchmarks/gpu.sh and the whole test suite, downloaded into
# .whl/ of this checkout for CPython 3.12 on x86-64 Linux, at the versions this machine's Python has where it
# has them. Run it where pip reaches a package index; then on the GPU machine, before gpu.sh:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
#
# wandb (about 20 MB with its own dependencies) is left out: gpu.sh leaves out the one test that needs it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/.whl"
PY="${PYTHON:-python3}"
# the project's own needs the image lacks, then hivemind and datasets with theirs (pure-Python sdists are built)
NAMES="zstandard greenlet mmh3
hivemind base58 blake3 cffi configargparse cryptography grpcio grpcio-tools protobuf msgpack morphys netaddr
prefetch-generator py-cid py-multibase py-multicodec py-multihash pycparser pydantic pydantic-core
python-baseconv sniffio typing-inspection varint annotated-types platformdirs
datasets dill multiprocess"
mkdir -p "$OUT"
grep -qs '^/.whl/$' "$ROOT/.git/info/exclude" || echo "/.whl/" >> "$ROOT/.git/info/exclude"
PLATFORMS=()
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 \
         manylinux1 manylinux_2_5; do PLATFORMS+=(--platform "${p}_x86_64"); done
for name in $NAMES; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ { print $2 }' || true)
    spec="$name${version:+==$version}"
    if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${PLATFORMS[@]}" -d "$OUT" "$spec" 2>/dev/null; then
        "$PY" -m pip wheel -q --no-deps -w "$OUT" "$spec"  # a pure-Python sdist: its wheel is built here
    fi
    echo "[gpu_wheels] $spec"
done
du -sh "$OUT"
