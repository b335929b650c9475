"""Diagnose a failing PIECEWISE CUDA-graph capture of a pack (device machine; a diagnostic, not product code).

    python3 packages/vllm-dsv41/scripts/gpu_capture_probe.py PACK OUT

Wraps torch's stream/event calls (``Stream.wait_stream``, ``Stream.wait_event``, ``Event.record``,
``Event.wait``, ``torch.cuda.stream`` switches) and vLLM's breakable-graph segment boundaries, and logs every one
made while a capture is active, with the shortest useful stack, to OUT/capture_probe.log; then builds the LLM with
PIECEWISE graphs (which captures at start-up). The log's last segment shows which code forked a stream into the
capture without joining it before the next eager break.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> int:
    import torch

    out = Path(sys.argv[2])
    log = open(out / "capture_probe.log", "w")
    state = {"n": 0}

    def where() -> str:
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
        return " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-6:][::-1])

    def capturing() -> bool:
        try:
            return torch.cuda.is_current_stream_capturing()
        except Exception:  # noqa: BLE001
            return False

    def wrap(owner: type, name: str) -> None:
        orig = getattr(owner, name)

        def f(self, *a, **k):  # type: ignore[no-untyped-def]
            cur = torch.cuda.current_stream()
            if capturing() or state.get("seg_open"):
                state["n"] += 1
                log.write(f"{state['n']} {owner.__name__}.{name} self={getattr(self, 'cuda_stream', id(self))} "
                          f"args={[getattr(x, 'cuda_stream', type(x).__name__) for x in a]} cur={cur.cuda_stream} "
                          f"capturing={capturing()} at {where()}\n")  # fmt: skip
            return orig(self, *a, **k)

        setattr(owner, name, f)

    for owner, name in ((torch.cuda.Stream, "wait_stream"), (torch.cuda.Stream, "wait_event"),
                        (torch.cuda.Event, "record"), (torch.cuda.Event, "wait")):  # fmt: skip
        wrap(owner, name)
    from vllm.compilation import breakable_cudagraph as bc

    for name in ("_begin_segment", "_end_segment", "add_eager"):
        orig = getattr(bc.BreakableCUDAGraphCapture, name)

        def g(self, *a, _orig=orig, _name=name, **k):  # type: ignore[no-untyped-def]
            log.write(f"--- {_name} cur={torch.cuda.current_stream().cuda_stream} at {where()}\n")
            log.flush()
            if _name == "_begin_segment":
                state["seg_open"] = True
            r = _orig(self, *a, **k)
            if _name == "_end_segment":
                state["seg_open"] = False
            return r

        setattr(bc.BreakableCUDAGraphCapture, name, g)
    try:
        from vllm_dsv41.fidelity import build_llm

        build_llm(sys.argv[1], runtime="all-in-vram", gpu_memory_gib=24)
        log.write("CAPTURE OK\n")
        print("CAPTURE OK")
    except BaseException as e:  # noqa: BLE001
        log.write(f"FAILED: {type(e).__name__}: {e}\n")
        print(f"FAILED: {type(e).__name__}: {str(e)[:300]}")
    finally:
        log.close()
    os.system(f"grep -n -B40 'FAILED' {out}/capture_probe.log | tail -60")
    return 0


if __name__ == "__main__":
    sys.exit(main())
