#!/bin/bash
# Session A (the benchmark lock held): local stack up, `turnkv plan calibrate`, the calibration capacity run
# (its own workload shape and seed), stack down. Run from the worktree root:
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-c/calibrate.sh
set -u
D=bench/twin_runs/2026-12-06-c
TK="nice -n 19 /work/main/.venv/bin/turnkv"
export PYTHONPATH=$PWD
date -u +"start %FT%TZ" > $D/calibrate.log
uptime >> $D/calibrate.log
vmstat -t 2 > $D/calib-vmstat.txt & VM=$!
$TK local up >> $D/calibrate.log 2>&1
uptime >> $D/calibrate.log
$TK plan calibrate >> $D/calibrate.log 2>&1
cp .turnkv/plan-calibration.json $D/calibration.json
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 10 --system-words 150 --first-user-words 250 \
  --turn-words 150 --max-tokens 32 --seed 101 --records --out $D/calib-capacity > $D/calib-capacity.log 2>&1
uptime >> $D/calibrate.log
$TK local down >> $D/calibrate.log 2>&1
kill $VM
date -u +"end %FT%TZ" >> $D/calibrate.log
