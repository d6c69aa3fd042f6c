"""casstore: content-addressed checkpoints for JAX pytrees on local disk, S3, GCS or any fsspec URL.

Array leaves are cut along shard boundaries into chunks named by the xxh3-128 of their raw bytes,
zstd-compressed and written once; a msgpack manifest per step, written last and create-only,
commits the checkpoint. See ``docs/format.md``.
"""

from importlib.metadata import PackageNotFoundError, version

from ._copy import CopyInfo as CopyInfo
from ._copy import CopyProgress as CopyProgress
from ._copy import copy as copy
from ._errors import AccessDeniedError as AccessDeniedError
from ._errors import CasstoreError as CasstoreError
from ._errors import CorruptChunkError as CorruptChunkError
from ._errors import ManifestError as ManifestError
from ._errors import ObjectNotFoundError as ObjectNotFoundError
from ._errors import ReadOnlyStoreError as ReadOnlyStoreError
from ._errors import StepAlreadyExistsError as StepAlreadyExistsError
from ._errors import StepNotFoundError as StepNotFoundError
from ._errors import StoreTimeoutError as StoreTimeoutError
from ._errors import TargetMismatchError as TargetMismatchError
from ._errors import UnsupportedLeafError as UnsupportedLeafError
from ._fallback import FallbackStore as FallbackStore
from ._gc import GcInfo as GcInfo
from ._gc import gc as gc
from ._manager import CheckpointManager as CheckpointManager
from ._manifest import ChunkRef as ChunkRef
from ._manifest import LeafEntry as LeafEntry
from ._manifest import Manifest as Manifest
from ._orbax import import_orbax as import_orbax
from ._repository import delete as delete
from ._repository import latest_step as latest_step
from ._repository import list_runs as list_runs
from ._repository import list_steps as list_steps
from ._repository import read_manifest as read_manifest
from ._restore import restore as restore
from ._save import SaveInfo as SaveInfo
from ._save import save as save
from ._tiers import PersistError as PersistError
from ._verify import Problem as Problem
from ._verify import VerifyReport as VerifyReport
from ._verify import verify as verify
from .store import FsspecStore as FsspecStore
from .store import LocalStore as LocalStore
from .store import MemoryStore as MemoryStore
from .store import ObjectInfo as ObjectInfo
from .store import Store as Store
from .store import open_store as open_store

try:
    __version__ = version("casstore")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+unknown"
