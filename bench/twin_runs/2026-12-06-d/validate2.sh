#!/bin/bash
# Attempt 4, repeat (session E) (the benchmark lock held), after the predictions were committed: stack up, the two
# validation workloads (never seen by the twin), stack down.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-d/validate.sh
set -u
D=bench/twin_runs/2026-12-06-d
TK="nice -n 19 /work/main/.venv/bin/turnkv"
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/validate2.log
uptime >> $D/validate2.log
vmstat -t 2 > $D/validate2-vmstat.txt & VM=$!
$TK local up >> $D/validate2.log 2>&1
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 12 --system-words 60 --first-user-words 100 \
  --turn-words 60 --max-tokens 64 --seed 808 --records --out $D/w9-capacity > $D/w9-capacity.log 2>&1
uptime >> $D/validate2.log
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 12 --system-words 300 --first-user-words 600 \
  --turn-words 150 --max-tokens 16 --seed 909 --records --out $D/w10-capacity > $D/w10-capacity.log 2>&1
uptime >> $D/validate2.log
$TK local down >> $D/validate2.log 2>&1
kill $VM
date -u +"end %FT%TZ" >> $D/validate2.log
