#!/usr/bin/env bash
# The default model (joined from the pieces earlier calls copied to /tmp/pieces, sha256
# checked), then the CI needle test with the corpus ingested on the GPU: every index at its
# default spec, ivf's now ivf256,np8,hot8,norope,all.
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
mkdir -p /tmp/home/models $OUT/tests
cat /tmp/pieces/part-* > /tmp/home/models/gemma-3-270m-q4_k_m.gguf
sha256sum /tmp/home/models/gemma-3-270m-q4_k_m.gguf | tee $OUT/model.sha256
(cd /tmp && KVDB_HOME=/tmp/home KVDB_TEST_DEVICE=cuda timeout 300 $B/test-retrieval --nocapture \
    every_index_finds_the_needle_at_its_default_spec) > $OUT/tests/test-retrieval.log 2>&1
grep -h "selectivity\|answered\|test result\|panicked" $OUT/tests/test-retrieval.log | cut -c1-300
