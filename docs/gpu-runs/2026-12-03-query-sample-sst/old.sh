#!/usr/bin/env bash
# First call: the binaries to compare against, carried in `.gpu-old/` (xz), unpacked into
# /tmp/old, which stays while the machine is warm (kvdb-wal: 8423322, the query sample through
# the log; kvdb-3fa: 3fa840d, no query sample).
set -e
mkdir -p /tmp/old
for f in .gpu-old/*.xz; do xz -dc "$f" > /tmp/old/$(basename "$f" .xz); done
chmod +x /tmp/old/*
ls -la /tmp/old
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt
cat $OUT/device.txt
