"""pack-tools: download, build, verify, inspect and synthesize DeepSeek-V4.1 EXL3 model packs.

Public API (also the ``pack-tools`` CLI):

* :func:`build_pack` - the overlay pack from the EXL3 checkpoint and the Engram shards;
* :func:`verify_pack` - every problem of a pack, one line each (``[]`` when valid);
* :func:`inspect_pack` - layers, experts, bits, bytes per tier and the server's RAM / VRAM / disk needs;
* :func:`download_inputs` - the pinned inputs through huggingface_hub;
* :func:`synth` - synthetic inputs or packs by preset name;
* :func:`pack_tools.manifest.write_manifest` - the manifest of any pack directory.
"""

from importlib.metadata import version as _version

__version__ = _version("pack-tools")

from pack_tools.build import build_pack
from pack_tools.config import PackConfig
from pack_tools.download import download_inputs
from pack_tools.errors import PackError
from pack_tools.inspection import inspect_pack
from pack_tools.manifest import write_manifest
from pack_tools.presets import synth
from pack_tools.verify import verify_pack

__all__ = [
    "PackConfig",
    "PackError",
    "__version__",
    "build_pack",
    "download_inputs",
    "inspect_pack",
    "synth",
    "verify_pack",
    "write_manifest",
]
