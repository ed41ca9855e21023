#!/usr/bin/env bash
# The GPU ingest keeps only its query sample (one position in 16 of each global layer): the
# kernel tests of the attention inputs (the sample's rows against the f64 reference, the
# refusals), the model's stored queries against the CPU's, the GPU ingest against the CPU's
# (test-gpu_ingest) and answers from GPU-ingested corpora (test-gpu_query); then the
# Llama-3-8B shape (random weights) ingesting three copies of the GPL on the GPU with this
# build, with 3fa840d's (no query sample on the GPU) and with eaa9330's (every row of every
# layer kept on the GPU, the sample taken from them), in one run: seconds and the GPU's
# memory in use, sampled every 100 ms.
set -x
rm -rf /tmp/kvdb; mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
export LD_LIBRARY_PATH=/tmp/kvdb/lib
B=/tmp/kvdb/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
mkdir -p $OUT/tests $OUT/ingest
(cd /tmp && timeout 200 $B/test-ops --nocapture attention_inputs bad_lengths_are_errors) > $OUT/tests/test-ops.log 2>&1
(cd /tmp && timeout 150 $B/test-gpu_model --nocapture stored) > $OUT/tests/test-gpu_model.log 2>&1
(cd /tmp && KVDB_BIN=$B/kvdb timeout 200 $B/test-gpu_ingest --nocapture) > $OUT/tests/test-gpu_ingest.log 2>&1
(cd /tmp && KVDB_BIN=$B/kvdb timeout 200 $B/test-gpu_query --nocapture) > $OUT/tests/test-gpu_query.log 2>&1
grep -h "^test \|test result" $OUT/tests/*.log
W=/tmp/qs; mkdir -p $W/docs
$B/random_model --preset llama3-8b --dtype bf16 --context 262144 --out $W/llama.gguf 2>&1 | tail -1
for i in 1 2 3; do { echo "Copy $i of the license."; cat /usr/share/common-licenses/GPL-3; } > $W/docs/copy-$i.txt; done
for run in new:$B/kvdb 3fa:/tmp/old/kvdb-3fa eaa:/tmp/old/kvdb-eaa new2:$B/kvdb; do
    name=${run%%:*} bin=${run#*:}
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > $OUT/ingest/$name.gpu-mib &
    smi=$!
    s=$(date +%s.%N)
    timeout 150 $bin ingest --device cuda --model $W/llama.gguf --store $W/store-$name --corpus c $W/docs > $OUT/ingest/$name.log 2>&1
    rc=$?
    e=$(date +%s.%N)
    kill $smi
    peak=$(sort -n $OUT/ingest/$name.gpu-mib | tail -1)
    echo "$name rc $rc: $(awk "BEGIN{printf \"%.1f\", $e - $s}") s, GPU memory peak $peak MiB; $(grep -o '[0-9,]* tokens' $OUT/ingest/$name.log | tail -1)"
    rm -rf $W/store-$name
done | tee $OUT/ingest/summary.txt
