#!/usr/bin/env bash
# Checks that every cargo command a developer or CI runs shares one build of the native
# libraries. RocksDB's and faiss's C++ (~15 minutes from nothing) is compiled by build
# scripts, and Cargo runs such a script again, in a directory of its own, whenever anything
# the script is built from differs: the build tools it uses (bindgen, cc, cmake and what they
# pull in) get their features unified over what one command builds, so a command that leaves
# crates out can see other features (workspace-hack/Cargo.toml pins them).
#
# For the whole workspace with every target (what scripts/setup.sh builds), without its
# tests, and for each crate alone with its default and with all its features, it asks Cargo
# for the units it would build (`--unit-graph`: nothing is compiled; it is an unstable flag,
# which RUSTC_BOOTSTRAP=1 unlocks on a stable toolchain) and compares what each native build
# script is built from. Exits 1 and names the difference when one comes back; runs in about
# a minute.
set -euo pipefail
cd "$(dirname "$0")/.."

# Prints one line per native build-script run: the package and a digest of every unit it
# depends on, transitively (package, features, profile, mode).
signatures() {
    RUSTC_BOOTSTRAP=1 cargo build --release "$@" --unit-graph -Z unstable-options 2>/dev/null |
        python3 -c '
import hashlib, json, sys
units = json.load(sys.stdin)["units"]
native = ("librocksdb-sys@", "faiss-sys@", "lz4-sys@")
memo = {}
def describe(i):
    if i not in memo:
        u = units[i]
        own = json.dumps([u["pkg_id"], u["target"]["name"], u["features"], u["profile"], u["mode"]])
        memo[i] = own + "".join(sorted(describe(d["index"]) for d in u["dependencies"]))
    return memo[i]
for i, u in enumerate(units):
    name = u["pkg_id"].split("#")[-1]
    if u["mode"] == "run-custom-build" and name.startswith(native):
        print(name, hashlib.sha256(describe(i).encode()).hexdigest()[:16])'
}

reference=$(signatures --workspace --all-targets)
if [ -z "$reference" ]; then
    echo "check-native-builds: cargo printed no unit graph (cargo build --unit-graph failed)" >&2
    exit 2
fi
status=0
compare() {
    local label=$1
    shift
    local sigs extra
    # Its own step, so that a failing `cargo build --unit-graph` stops the script (set -e)
    # instead of reading as "nothing differs".
    if ! sigs=$(signatures "$@"); then
        echo "check-native-builds: \`cargo build --release $* --unit-graph\` failed" >&2
        exit 2
    fi
    extra=$(grep -vxF "$reference" <<<"$sigs" || true)
    if [ -n "$extra" ]; then
        echo "check-native-builds: \`cargo build --release $*\` would compile these native libraries again ($label):"
        echo "$extra" | sed 's/^/  /'
        status=1
    fi
}
compare "the binaries alone" --workspace --bins
members=$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json, sys; print(" ".join(p["name"] for p in json.load(sys.stdin)["packages"]))')
for member in $members; do
    compare "$member alone" -p "$member" --all-targets
    compare "$member alone, no tests" -p "$member"
    compare "$member with all its features" -p "$member" --all-targets --all-features
done
if [ $status -eq 0 ]; then
    echo "check-native-builds: every command shares the workspace's build of RocksDB and faiss"
fi
exit $status
