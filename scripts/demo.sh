#!/usr/bin/env bash
# kvdb's main job on the default model, in one command: fetch the model, ingest about 8K
# tokens of real public text (two chapters of the Debian Reference, HTML, from Debian's
# package registry), then ask the corpus a question and show the answer with the passages it
# attended to. Everything lands under $KVDB_HOME (default ~/.cache/kvdb); a second run skips
# the documents already ingested and only asks.
#
#   scripts/demo.sh ["your question"]
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/kvdb/target}"
home="${KVDB_HOME:-$HOME/.cache/kvdb}"
demo="$home/demo"
question="${1:-Question: In the Debian Reference, what is Internationalization (I18N)? Answer: Internationalization (I18N) means}"

cargo build --release -q -p kvdb-cli
kvdb="$CARGO_TARGET_DIR/release/kvdb"
"$kvdb" model fetch

# The text: debian-reference-en from Debian's registry (`apt-get download` needs no root).
text="$demo/text"
if [ ! -s "$text/ch08.en.html" ]; then
  mkdir -p "$demo/deb" "$text"
  (cd "$demo/deb" && apt-get download -q debian-reference-en)
  dpkg-deb -x "$demo"/deb/debian-reference-en_*.deb "$demo/deb/root"
  cp "$demo/deb/root/usr/share/debian-reference/pr01.en.html" "$text/"
  cp "$demo/deb/root/usr/share/debian-reference/ch08.en.html" "$text/"
fi

"$kvdb" ingest --store "$demo/store" --corpus debian-reference "$text/pr01.en.html" "$text/ch08.en.html"
"$kvdb" corpus info --store "$demo/store" --corpus debian-reference
echo
echo "Q: $question"
"$kvdb" ask --store "$demo/store" --corpus debian-reference --max-tokens 40 --stop $'\n' "$question"
