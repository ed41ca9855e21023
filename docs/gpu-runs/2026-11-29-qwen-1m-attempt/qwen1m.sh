#!/usr/bin/env bash
# Qwen2.5-7B-1M shape at 1,017,000 tokens on one H200: store on tmpfs, run in the background,
# polled by consecutive device calls. Usage: qwen1m.sh start|wait SECONDS
set -u
mode=$1 limit=${2:-560}
if [ "$mode" = start ]; then
    mkdir -p /tmp/kvdb && tar -xJf .gpu-bundle/bundle.tar.xz -C /tmp/kvdb
    cp scripts/gpu-query-bench.sh /tmp/kvdb/
    id -u; nproc; free -g; df -h / /dev/shm /tmp; nvidia-smi --query-gpu=name,memory.total --format=csv
    avail=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
    if [ "$avail" -lt 70 ]; then mount -o remount,size=100G /dev/shm && df -h /dev/shm; fi
    mkdir -p /dev/shm/qb /tmp/qout
    nohup env OUT=/tmp/qout COPIES_GEMMA=0 COPIES_LLAMA=0 COPIES_QWEN=34 IVF_QWEN=ivf256,np8,norope,all \
        CONTEXT=1100000 FOLLOW=8 STORE_DIR=/dev/shm/qb bash /tmp/kvdb/gpu-query-bench.sh /tmp/kvdb /tmp/qb \
        >/tmp/qout/run.log 2>&1 &
    echo $! >/tmp/qout/pid
fi
pid=$(cat /tmp/qout/pid)
start=$(date +%s)
while kill -0 "$pid" 2>/dev/null && [ $(($(date +%s) - start)) -lt "$limit" ]; do
    sleep 30
    echo "== $(date -u +%T) mem used $(free -g | awk '/Mem/{print $3}')G shm $(df --output=used -BG /dev/shm | tail -1)"
    tail -n 2 /tmp/qout/run.log; tail -n 2 /tmp/qout/ingest-*.log 2>/dev/null; tail -c 300 /tmp/qout/stderr.log 2>/dev/null; echo
done
kill -0 "$pid" 2>/dev/null && echo STILL RUNNING || echo FINISHED
cp -r /tmp/qout "$OUT/"
du -sh /dev/shm/qb /tmp/qb 2>/dev/null
