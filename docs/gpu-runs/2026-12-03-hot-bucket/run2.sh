#!/usr/bin/env bash
# The default model (joined from its pieces, sha256 checked): every index at its default spec
# answers the needle with the corpus ingested on the GPU (ivf's default now with hot keys);
# then Gemma 3 270M's shape (random weights) over one copy of the GPL: ingested on the GPU
# with the new default, the old default added, decode-bench of both.
set -x
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
mkdir -p /tmp/home/models $OUT/tests $OUT/g
cat /tmp/pieces/part-* > /tmp/home/models/gemma-3-270m-q4_k_m.gguf
sha256sum /tmp/home/models/gemma-3-270m-q4_k_m.gguf | tee $OUT/model.sha256
(cd /tmp && KVDB_HOME=/tmp/home KVDB_TEST_DEVICE=cuda timeout 200 $B/test-retrieval --nocapture \
    every_index_finds_the_needle_at_its_default_spec) > $OUT/tests/test-retrieval.log 2>&1
grep -h "selectivity\|test result" $OUT/tests/test-retrieval.log
cp scripts/gpu-query-bench.sh /tmp/kvdb/
OUT=$OUT/g COPIES_GEMMA=1 COPIES_LLAMA=0 GEMMA_DEVICES=cuda REPEATS=2 timeout 120 bash /tmp/kvdb/gpu-query-bench.sh /tmp/kvdb /tmp/gb > $OUT/g/script.log 2>&1
timeout 60 $B/kvdb index add --model /tmp/gb/gemma3-270m.gguf --store /tmp/gb/store-gemma3-270m --corpus c ivf256,np8,norope,all > $OUT/g/index-add.log 2>&1
$B/kvdb index list --store /tmp/gb/store-gemma3-270m --corpus c >> $OUT/g/index-add.log 2>&1
timeout 90 $B/kvdb decode-bench --device cuda --model /tmp/gb/gemma3-270m.gguf --store /tmp/gb/store-gemma3-270m \
    --corpus c --index ivf256,np8,hot10,norope,all --index ivf256,np8,norope,all --tokens 32 --repeats 3 \
    --json $OUT/g/decode-both.json > $OUT/g/decode-both.log 2>&1
tail -5 $OUT/g/query.log
grep -v "^kvdb:" $OUT/g/decode-both.log | tail -12
