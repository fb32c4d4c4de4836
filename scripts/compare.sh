#!/usr/bin/env bash
# Compares two kvferry binaries on the demo configurations of docs/performance.md:
#   bash scripts/compare.sh NEW_BINARY OLD_BINARY > compare.txt
# Runs each demo configuration back to back, alternating the binaries, and prints
# one JSON line per run with the request p50 in bare ZeroMQ round trips.
# Needs python3 and perf (for the last step); takes about 2 minutes on 2 cores.
set -u
N=${1:?new binary}; H=${2:?old binary}
S="--requests 3000 --concurrency 1 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --zmq-baseline --json"
f() { python3 -c "
import json,sys; d=json.load(sys.stdin)
out={k:(round(v,4) if isinstance(v,float) else v) for k,v in d.items() if k in ('ok','failed','expired','verify_errors','gbps','requests_per_s','p50_ms','p99_ms','zmq_rtt_p50_ms','zmq_rtt_two_ctx_p50_ms')}
r=''
if d.get('zmq_rtt_p50_ms'): r='ratio one-ctx %.2f' % (d['p50_ms']/d['zmq_rtt_p50_ms'])
if d.get('zmq_rtt_two_ctx_p50_ms'): r+=' two-ctx %.2f' % (d['p50_ms']/d['zmq_rtt_two_ctx_p50_ms'])
print(json.dumps(out), r)"; }
date
echo "== small conc1, unpinned"; for i in 1 2 3 4 5 6 7 8; do echo -n "new "; $N demo $S 2>/dev/null | f; echo -n "old "; $H demo $S 2>/dev/null | f; done
echo "== small conc1, whole process on core 0"; for i in 1 2 3 4 5; do echo -n "new "; taskset -c 0 $N demo $S 2>/dev/null | f; echo -n "old "; taskset -c 0 $H demo $S 2>/dev/null | f; done
for i in 1 2; do echo -n "new --zmq-only "; $N demo $S --zmq-only 2>/dev/null | f; done
echo "== small 256"; for i in 1 2; do echo -n "new "; $N demo --requests 20000 --concurrency 256 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json 2>/dev/null | f; echo -n "old "; $H demo --requests 20000 --concurrency 256 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json 2>/dev/null | f; done
echo "== defaults"; for i in 1 2; do echo -n "new "; $N demo --json 2>/dev/null | f; echo -n "old "; $H demo --json 2>/dev/null | f; done
echo "== large"; for i in 1 2 3; do echo -n "new "; $N demo --requests 100 --concurrency 16 --layers 32 --blocks-per-request 64 --json 2>/dev/null | f; echo -n "old "; $H demo --requests 100 --concurrency 16 --layers 32 --blocks-per-request 64 --json 2>/dev/null | f; done
echo "== pull defaults"; echo -n "new "; $N demo --json --mode pull 2>/dev/null | f; echo -n "old "; $H demo --json --mode pull 2>/dev/null | f
echo "== pull small conc1"; for i in 1 2 3; do echo -n "new "; $N demo $S --mode pull 2>/dev/null | f; echo -n "old "; $H demo $S --mode pull 2>/dev/null | f; done
echo "== pull small conc1 core0"; for i in 1 2; do echo -n "new "; taskset -c 0 $N demo $S --mode pull 2>/dev/null | f; echo -n "old "; taskset -c 0 $H demo $S --mode pull 2>/dev/null | f; done
echo "== pull small 256"; for i in 1 2; do echo -n "new "; $N demo --requests 20000 --concurrency 256 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json --mode pull 2>/dev/null | f; echo -n "old "; $H demo --requests 20000 --concurrency 256 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json --mode pull 2>/dev/null | f; done
echo "== tp 4->2"; echo -n "new "; $N demo --json --prefill-tp 4 --decode-tp 2 2>/dev/null | f; echo -n "old "; $H demo --json --prefill-tp 4 --decode-tp 2 2>/dev/null | f
echo "== cpu per request, small conc1, 5000 requests"; for b in $N $H; do /usr/bin/time -f "$b user %U s sys %S s wall %e s" $b demo --requests 5000 --concurrency 1 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json 2>&1 >/dev/null | tail -1; done
echo "== system calls per small request (perf stat, core 0, 5000 requests)"; for b in $N $H; do echo -n "$b "; taskset -c 0 perf stat -x, -e raw_syscalls:sys_enter -e syscalls:sys_enter_io_uring_enter -e context-switches $b demo --requests 5000 --concurrency 1 --layers 1 --blocks-per-request 1 --heads 1 --head-bytes 8 --json 2>&1 >/dev/null | awk -F, '{printf "%s=%.1f/req ", $3, $1/5000}'; echo; done
date
