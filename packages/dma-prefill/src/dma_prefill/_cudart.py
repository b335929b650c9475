"""The few CUDA runtime calls the host store needs: register/unregister host memory, its device pointer.

Registration goes through ``torch.cuda.cudart()`` (the libcudart torch is linked against). The device pointer
of mapped memory comes from ``cudaHostGetDevicePointer`` through ctypes on that same libcudart when it can be
found in the process; on 64-bit Linux with unified addressing it equals the host pointer, which is the fallback.
"""

from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["HOST_REGISTER_MAPPED", "HOST_REGISTER_PORTABLE", "device_pointer", "host_register", "host_unregister"]

HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2


def _check(err: object, what: str) -> None:
    code = int(err)  # type: ignore[call-overload]
    if code != 0:
        raise RuntimeError(f"{what} failed with cudaError {code}")


def host_register(ptr: int, nbytes: int, flags: int = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for DMA (and map it into the GPU address space)."""
    torch.cuda.init()
    _check(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags), f"cudaHostRegister({nbytes} bytes)")


def host_unregister(ptr: int) -> None:
    _check(torch.cuda.cudart().cudaHostUnregister(ptr), "cudaHostUnregister")


@functools.cache
def _libcudart() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for p in sorted(paths):
        try:
            lib = ctypes.CDLL(p)
            lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
            lib.cudaHostGetDevicePointer.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def device_pointer(host_ptr: int) -> tuple[int, bool]:
    """Device address of registered+mapped host memory; the bool says whether the runtime was asked.

    Returns ``(host_ptr, False)`` when libcudart is not reachable through ctypes (unified addressing: the
    same address is valid on the GPU for memory registered with the mapped flag).
    """
    lib = _libcudart()
    if lib is None:
        return host_ptr, False
    out = ctypes.c_void_p()
    _check(lib.cudaHostGetDevicePointer(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0), "cudaHostGetDevicePointer")
    return int(out.value or 0), True


class CudaArray:
    """A raw device allocation exposed through ``__cuda_array_interface__`` (for ``torch.as_tensor``)."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self._owner = owner  # keeps the host memory alive as long as any view of it
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
