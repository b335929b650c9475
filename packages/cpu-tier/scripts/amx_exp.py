import numpy as np, sys
from cpu_tier import exl3
from cpu_tier._loader import load
mod = load("avx512")
t = exl3.random_tensor(5120, 256, 3, "mul1", seed=1)
for amx in (True, False):
    rt = mod.Runtime(1, [3], 50, amx=amx)
    ghz = float(np.median(rt.clock_ghz()))
    for m in (1, 8):
        for v in ((0, 1, 2, 3, 4, 5) if amx else (0, 2)):
            sec = min(rt.kernel_band_seconds(t.trellis, t.suh.view(np.uint16), t.svh.view(np.uint16), 2, True, m, 1, 200, v)[0] for _ in range(3))
            cw = sec * ghz * 1e9 / (5120 * 128)
            print(f"amx={amx} m={m} variant={v}: {sec*1e6:8.1f} us/band  {cw:.3f} cycles/weight  ({ghz:.2f} GHz)", flush=True)
    rt.close()
