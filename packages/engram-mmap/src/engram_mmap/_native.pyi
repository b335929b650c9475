"""engram_mmap native core: file mappings and the parallel row gather"""

from numpy.typing import NDArray


class Mapping:
    """A read-only shared mapping of one whole file."""

    def __init__(self, fd: int, size: int, path: str, random_access: bool) -> None: ...

    @property
    def size(self) -> int: ...

    @property
    def path(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

    def current_file_size(self) -> int: ...

    def evict(self) -> None: ...

    def resident(self, offset: int, length: int) -> tuple[int, int]:
        """(resident pages, pages) of a byte range, from mincore"""

class Work:
    """Completion of an asynchronous prefetch."""

    def done(self) -> bool: ...

    def wait(self) -> int: ...

class PendingGather:
    """Completion of an asynchronous gather."""

    def done(self) -> bool: ...

    def wait(self) -> int: ...

class Table:
    """The row gather over a mapped weight tensor and its scale tensor."""

    def __init__(self, weight_mapping: Mapping, weight_offset: int, weight_row_bytes: int, scale_mapping: Mapping, scale_offset: int, scale_row_bytes: int, rows: int, n_threads: int, dedup: bool, readahead_max_rows: int, resident_scales: bool) -> None: ...

    @property
    def rows(self) -> int: ...

    @property
    def n_threads(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def resident_scales(self) -> bool: ...

    def gather(self, row_ids: NDArray, out_rows: NDArray, out_scales: NDArray, zero_invalid: bool = False) -> int:
        """
        Gather rows; returns the number of distinct rows read. zero_invalid: ids outside the table give zero bytes instead of an error.
        """

    def gather_async(self, row_ids: NDArray, out_rows: NDArray, out_scales: NDArray, zero_invalid: bool = False) -> PendingGather: ...

    def prefetch(self, row_ids: NDArray) -> None: ...

    def prefetch_async(self, row_ids: NDArray) -> Work: ...

    def close(self) -> None: ...

def random_read(path: str, lo: int, hi: int, n_reads: int, n_threads: int, block: int, direct: bool, seed: int) -> float:
    """
    Wall seconds for n_reads random block reads (pread, O_DIRECT when direct) of [lo, hi) of a file.
    """
