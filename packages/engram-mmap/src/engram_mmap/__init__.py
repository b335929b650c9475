"""engram-mmap: Engram n-gram hashing and the memory-mapped gather of Engram table rows.

Public API (stable; see the package README):

* :class:`EngramConfig` - hash geometry from a DeepSeek config (``from_hf_config``), primes,
  offsets, multipliers, ``table_rows(layer)``.
* :func:`build_token_map`, :class:`EngramHasher` - token ids -> row ids (``row_ids``).
* :class:`EngramTable`, :class:`TableConfig` - a table mapped from safetensors shards; ``gather``,
  ``gather_async``, ``prefetch``; :func:`table_prefix`, :func:`table_tensor_layer` - the tables' tensor names.
* :func:`dequantize` - fp8 E4M3 rows x E8M0 scales -> float32 / bfloat16.
* :mod:`engram_mmap.safetensors_header` - the project's safetensors header reader: :func:`parse_header`
  (:class:`Header`, :class:`TensorInfo`), :func:`header_problems`, :func:`read_header`.
"""

from importlib.metadata import version as _version

from .config import EngramConfig
from .dequant import dequantize
from .hashing import EngramHasher, build_token_map
from .safetensors_header import (
    EngramFormatError,
    Header,
    SafetensorsFormatError,
    TensorInfo,
    header_problems,
    parse_header,
    read_header,
)
from .table import (
    TABLE_TENSOR_RE,
    EngramTable,
    GatherHandle,
    PrefetchHandle,
    TableConfig,
    table_prefix,
    table_tensor_layer,
)

__version__ = _version("engram-mmap")
__all__ = [
    "TABLE_TENSOR_RE",
    "EngramConfig",
    "EngramFormatError",
    "EngramHasher",
    "EngramTable",
    "GatherHandle",
    "Header",
    "PrefetchHandle",
    "SafetensorsFormatError",
    "TableConfig",
    "TensorInfo",
    "__version__",
    "build_token_map",
    "dequantize",
    "header_problems",
    "parse_header",
    "read_header",
    "table_prefix",
    "table_tensor_layer",
]
