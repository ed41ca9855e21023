#!/usr/bin/env bash
# GPU check of the stored preload: its tests, then an ingest of the Llama-3-8B shape cut and
# resumed, each progress event stamped with the time.
set -u
mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
timeout 100 $B/test-gpu_model --test-threads 1 --nocapture stored >$OUT/gpu_model.log 2>&1; echo "gpu_model rc=$?"
timeout 100 $B/test-gpu_ingest --test-threads 1 resumes >$OUT/gpu_ingest.log 2>&1; echo "gpu_ingest rc=$?"
tail -3 $OUT/gpu_model.log $OUT/gpu_ingest.log
$B/random_model --preset llama3-8b --dtype bf16 --context 262144 --out /tmp/llama.gguf | tail -1
mkdir -p /tmp/docs
for i in 1 2 3; do { echo "Copy $i"; cat /usr/share/common-licenses/GPL-3; } >/tmp/docs/copy-$i.txt; done
stamp() { while IFS= read -r l; do echo "$(date +%s.%N) $l"; done; }
timeout 35 $B/kvdb ingest --device cuda --model /tmp/llama.gguf --store /tmp/st --corpus c --progress json /tmp/docs 2>&1 | stamp >$OUT/cut.jsonl
du -sh /tmp/st
timeout 120 $B/kvdb ingest --device cuda --model /tmp/llama.gguf --store /tmp/st --corpus c --progress json /tmp/docs 2>&1 | stamp >$OUT/resume.jsonl
grep -v '"chunk\|"committed' $OUT/resume.jsonl | head; tail -2 $OUT/resume.jsonl
