#!/bin/bash
# Attempt 4, pressure (the benchmark lock held), after the prediction was committed: bench pressure on a stack of
# its own (retained_kv_share 0.01: room for about two of these conversations), levels 1,2,4,8 x what fits, 4 turns,
# 1 s think, exact 96-token replies, at most 8 minutes.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-d/pressure.sh
set -u
D=bench/twin_runs/2026-12-06-d
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/pressure.log
uptime >> $D/pressure.log
vmstat -t 2 > $D/pressure-vmstat.txt & VM=$!
nice -n 19 /work/main/.venv/bin/python -m bench.pressure --levels 1,2,4,8 \
  --variant "device only=retained_kv_share=0.01" --stack-per variant --turns 4 --think fixed:1 \
  --system-words 100 --first-user-words 200 --turn-words 100 --max-tokens 96 --exact-replies --seed 606 \
  --max-minutes 8 --state-dir .turnkv/pressure --out $D/p1-pressure >> $D/pressure.log 2>&1
uptime >> $D/pressure.log
kill $VM
date -u +"end %FT%TZ" >> $D/pressure.log
