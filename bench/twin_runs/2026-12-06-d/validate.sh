#!/bin/bash
# Attempt 4, session D (the benchmark lock held), after the predictions were committed: stack up, the two
# validation workloads (never seen by the twin), stack down.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-d/validate.sh
set -u
D=bench/twin_runs/2026-12-06-d
TK="nice -n 19 /work/main/.venv/bin/turnkv"
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/validate.log
uptime >> $D/validate.log
vmstat -t 2 > $D/validate-vmstat.txt & VM=$!
$TK local up >> $D/validate.log 2>&1
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 12 --system-words 200 --first-user-words 300 \
  --turn-words 80 --max-tokens 24 --seed 404 --records --out $D/w7-capacity > $D/w7-capacity.log 2>&1
uptime >> $D/validate.log
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 12 --system-words 120 --first-user-words 200 \
  --turn-words 160 --max-tokens 40 --seed 505 --records --out $D/w8-capacity > $D/w8-capacity.log 2>&1
uptime >> $D/validate.log
$TK local down >> $D/validate.log 2>&1
kill $VM
date -u +"end %FT%TZ" >> $D/validate.log
