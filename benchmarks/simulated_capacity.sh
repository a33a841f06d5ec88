#!/usr/bin/env bash
# Can this machine hold 16 simulated engines at once? Starts them on 127.0.0.1:9300-9315, waits
# for /health, sends each one completion, prints the count, start time and total RSS, stops them.
#   bash benchmarks/simulated_capacity.sh
set -u
cd "$(dirname "$0")/.."
M=$(.venv/bin/python -c "from pagefleet.cache import demo_checkpoint; print(demo_checkpoint())")
pids=()
start=$(date +%s.%N)
for i in $(seq 0 15); do
  .venv/bin/pagefleet serve $M --simulate --host 127.0.0.1 --port $((9300+i)) --num-gpu-blocks-override 800 --uvicorn-log-level warning >/tmp/sim16_$i.log 2>&1 &
  pids+=($!)
done
for i in $(seq 0 15); do
  for t in $(seq 1 300); do curl -sf http://127.0.0.1:$((9300+i))/health >/dev/null && break; sleep 0.5; done
done
end=$(date +%s.%N)
ok=0; for i in $(seq 0 15); do curl -sf http://127.0.0.1:$((9300+i))/v1/completions -H 'Content-Type: application/json' -d '{"prompt":"hello world","max_tokens":8}' >/dev/null && ok=$((ok+1)); done
rss=$(ps -o rss= -p $(IFS=,; echo "${pids[*]}") | awk '{s+=$1} END {print s/1024}')
echo "healthy+answered: $ok/16 in $(echo "$end - $start" | bc) s; total RSS ${rss} MiB"
kill "${pids[@]}"; wait
