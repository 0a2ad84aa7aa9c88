#!/bin/bash
# Two-guest throughput: perftest (ib_read_bw/ib_write_bw) then the engine (bench.py), guest B reading/writing
# guest A. Needs IPv4 on eth0 (perftest's TCP exchange is IPv4-only):
#   python tests/rdma/testbed.py run2 --ipv4 --server 'bash tests/rdma/guest/bench2.sh server' \
#                                          --client 'bash tests/rdma/guest/bench2.sh client'
SIZES="65536 1048576"; TOTAL=$((32 << 20)); GIDX=1  # GID 1 = ::ffff:10.77.0.x (RoCE v2)
for t in ib_read_bw ib_write_bw; do for s in $SIZES; do
  if [ "$1" = server ]; then
    timeout 120 $t -d rxe0 -x $GIDX -s $s -n $((TOTAL / s)) -F >/dev/null 2>&1 || echo "$t $s: server failed"
  else
    for i in $(seq 20); do sleep 0.5; out=$(timeout 60 $t -d rxe0 -x $GIDX -s $s -n $((TOTAL / s)) -F "$UMBP_RDMA_PEER4" 2>&1) && break; done
    echo "perftest $t $s B: $(echo "$out" | awk -v s=$s '$1==s {printf "%.3f GB/s", $4 / 1000}')"
  fi
done; done
if [ "$1" = server ]; then
  exec python3 tests/rdma/guest/rdma_helpers.py serve --size $((16 << 20)) --host :: --port 18600 --clients 1
else
  exec python3 tests/rdma/guest/bench.py --peer "$UMBP_RDMA_PEER" --port 18600 --sizes "${SIZES// /,}" --total-mib 32
fi
