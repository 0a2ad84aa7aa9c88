import sys, time, os, json, subprocess
sys.path.insert(0, os.getcwd())
import numpy as np
t0 = time.monotonic()
import aetcd, uvloop
print("imports", time.monotonic() - t0, flush=True)
from umbp.launcher import LocalPool
import umbp
t0 = time.monotonic()
with LocalPool(nodes=2, capacity="128MiB", lease_ttl=4, echo=True) as pool:
    print("pool up", time.monotonic() - t0, pool.metaserver, flush=True)
    out = subprocess.run([sys.executable, "-m", "umbp", "nodes", "--json", "--metaserver", pool.metaserver], capture_output=True, text=True)
    print(out.stdout[:500], out.stderr[-500:], flush=True)
    with umbp.Client(pool.metaserver, transport="rdma") as c:
        v = os.urandom(1 << 20)
        t0 = time.monotonic(); print("put", c.put("a", v), time.monotonic() - t0, flush=True)
        t0 = time.monotonic(); print("get ok", c.get("a") == v, time.monotonic() - t0, c.transport_names(), flush=True)
        big = np.zeros(64 << 20, np.uint8); c.register_buffer(big)
        src = np.random.randint(0, 255, 64 << 20, dtype=np.uint8)
        keys = [f"k{i}" for i in range(64)]
        t0 = time.monotonic(); print(c.batch_put(keys, [src[i<<20:(i+1)<<20] for i in range(64)]), time.monotonic()-t0, flush=True)
        for _ in range(2):
            t0 = time.monotonic(); r = c.batch_get_into(keys, [big[i<<20:(i+1)<<20] for i in range(64)]); dt=time.monotonic()-t0
            print("get64x1M", set(r), dt, 64/1024/dt, "GB/s", np.array_equal(big, src), flush=True)
        print({n: t.ep.stats for n, t in c._transports.items()})
    with umbp.Client(pool.metaserver, transport="auto") as c:
        print(c.get("a") == v, c.transport_names())
print("done", flush=True)
