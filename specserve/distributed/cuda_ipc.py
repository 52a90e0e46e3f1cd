"""Device memory that other processes of one node map into their own address space (CUDA IPC), through the
CUDA runtime that torch loaded, called with ctypes.

torch's caching allocator cannot serve here: its blocks live inside larger segments (expandable ones, in this
engine: worker/kv_sizing.py), while an IPC handle names a whole cudaMalloc allocation. So a buffer shared with
the other ranks is allocated apart, with cudaMalloc, and freed by close().
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

import torch

# cudaIpcMemLazyEnablePeerAccess: the mapping enables peer access between the two devices on first use.
_LAZY_PEER_ACCESS = 1
_IPC_HANDLE_BYTES = 64


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * _IPC_HANDLE_BYTES)]


def _loaded_cudart_path() -> str | None:
    """The CUDA runtime library this process has loaded (torch's), from the process's memory map."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


class CudaRuntime:
    """The few runtime calls CUDA IPC needs; each raises RuntimeError with the runtime's message."""

    def __init__(self):
        torch.cuda.init()
        path = _loaded_cudart_path() or ctypes.util.find_library("cudart")
        if path is None:
            raise RuntimeError("the CUDA runtime (libcudart) is neither loaded by torch nor on the library path; "
                               "install torch with CUDA, or use all_reduce='nccl'")
        self._lib = ctypes.CDLL(path)
        self._lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _call(self, name: str, *args) -> None:
        code = getattr(self._lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed: {self._lib.cudaGetErrorString(code).decode()} (error {code})")

    def set_device(self, index: int) -> None:
        self._call("cudaSetDevice", ctypes.c_int(index))

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._call("cudaMalloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._call("cudaMemset", ctypes.c_void_p(ptr), ctypes.c_int(value), ctypes.c_size_t(nbytes))

    def free(self, ptr: int) -> None:
        self._call("cudaFree", ctypes.c_void_p(ptr))

    def ipc_handle(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._call("cudaIpcGetMemHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
        return bytes(handle)

    def open_ipc_handle(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        self._call("cudaIpcOpenMemHandle", ctypes.byref(ptr), _IpcHandle.from_buffer_copy(handle),
                   ctypes.c_uint(_LAZY_PEER_ACCESS))
        return ptr.value

    def close_ipc_handle(self, ptr: int) -> None:
        self._call("cudaIpcCloseMemHandle", ctypes.c_void_p(ptr))


@dataclass
class SharedBuffer:
    """One zeroed allocation per rank, each mapped by every rank: `addresses[r]` is rank r's allocation as this
    process sees it (its own at addresses[rank])."""

    runtime: CudaRuntime
    rank: int
    addresses: list[int]

    @classmethod
    def allocate(cls, runtime: CudaRuntime, nbytes: int, rank: int, all_gather) -> SharedBuffer:
        """A collective: every rank allocates nbytes and maps the others'; all_gather(bytes) -> [bytes per rank]
        exchanges the handles."""
        own = runtime.malloc(nbytes)
        runtime.memset(own, 0, nbytes)
        handles = all_gather(runtime.ipc_handle(own))
        addresses = [own if r == rank else runtime.open_ipc_handle(h) for r, h in enumerate(handles)]
        return cls(runtime, rank, addresses)

    def close(self) -> None:
        """Unmap the others' allocations and free this rank's."""
        for r, address in enumerate(self.addresses):
            if r != self.rank:
                self.runtime.close_ipc_handle(address)
        self.runtime.free(self.addresses[self.rank])
        self.addresses = []
