"""CUDA host functions queued on a stream: ``cuLaunchHostFunc`` of the CUDA driver API through ctypes (the driver's
``libcuda.so.1`` is present wherever CUDA runs; PyTorch exposes no launcher of host functions).

A host function runs on a driver thread once the stream has reached it; the stream's later work waits until it
returns. ``vllm_dsv41.tiered`` queues ``cpu_tier.StreamCall``'s submit and wait this way (``cpu_drive`` "stream")."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["HostFunctions"]


class HostFunctions:
    """The driver's ``cuLaunchHostFunc``, loaded once."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"CUDA host functions: cannot load the CUDA driver (libcuda.so.1): {e}") from None
        f = lib.cuLaunchHostFunc
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        f.restype = ctypes.c_int
        self._launch = f

    def launch(self, stream: torch.cuda.Stream, fn: int, arg: int) -> None:
        """Queue ``fn(arg)`` (a C function ``void(void*)``) on ``stream``; raises on a driver error."""
        rc = self._launch(stream.cuda_stream, fn, arg)
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc on stream {stream.cuda_stream:#x}: CUresult {rc}")
