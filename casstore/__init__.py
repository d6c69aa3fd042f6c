"""casstore: content-addressed checkpoints for JAX pytrees on local disk, S3, GCS or any fsspec URL.

Array leaves are cut along shard boundaries into chunks named by the xxh3-128 of their raw bytes,
zstd-compressed and written once; a msgpack manifest per step, written last and create-only,
commits the checkpoint. See ``docs/format.md``.

Public names are imported on first use (PEP 562 module ``__getattr__``), so ``import casstore``
and commands that need no arrays (``casstore --help``, ``casstore ls``) do not import jax.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

# public name -> the private module that defines it
_WHERE = {
    "CopyInfo": "_copy", "CopyProgress": "_copy_engine", "copy": "_copy",
    "FallbackStore": "_fallback",
    **dict.fromkeys(["AccessDeniedError", "CasstoreError", "CorruptChunkError", "ManifestError",
                     "MissingChunkError", "ObjectNotFoundError", "PersistError",
                     "ReadOnlyStoreError", "StepAlreadyExistsError", "StepNotFoundError",
                     "StoreTimeoutError", "StoreUnreachableError", "TargetMismatchError",
                     "TensorFileError", "UnsupportedFormatError", "UnsupportedLeafError"],
                    "_errors"),
    **dict.fromkeys(["ExportInfo", "ImportInfo", "check_export_path", "export_tensors",
                     "import_tensors"], "_export"),
    **dict.fromkeys(["LeafDiff", "LeafInfo", "StepInfo", "diff_manifests", "diff_steps",
                     "inspect_step", "manifest_as_dict"], "_inspect"),
    **dict.fromkeys(["RepositoryUsage", "RunUsage", "StepUsage", "object_sizes", "run_usage",
                     "step_usage", "usage"], "_usage"),
    "GcInfo": "_gc", "gc": "_gc", "GcBusyError": "_locks",
    "CheckpointManager": "_manager",
    "ChunkRef": "_manifest", "LeafEntry": "_manifest", "Manifest": "_manifest",
    "import_orbax": "_orbax", "UnsupportedItemError": "_orbax", "OrbaxReadError": "_orbax",
    "AsyncCheckpointer": "_async_save",
    **dict.fromkeys(["AnySavePolicy", "ContinuousCheckpointingPolicy", "DecisionContext",
                     "FixedIntervalPolicy", "InitialSavePolicy", "PolicyCheckpointInfo",
                     "PreemptionCheckpointingPolicy", "PreservationContext",
                     "SaveDecisionPolicy", "SpecificStepsPolicy"], "_policies"),
    **dict.fromkeys(["AnyPreservationPolicy", "BestN", "CustomSteps", "EveryNSteps", "LatestN",
                     "PreservationPolicy", "PreserveAll"], "_preservation"),
    **dict.fromkeys(["delete", "latest_step", "list_runs", "list_steps", "read_manifest"],
                    "_repository"),
    "RepairInfo": "_repair", "repair": "_repair",
    "restore": "_restore",
    "SaveInfo": "_save", "save": "_save",
    "PLACEHOLDER": "_target", "abstract_tree": "_target",
    **dict.fromkeys(["ManifestScan", "Problem", "is_repository", "scan_manifests"], "_scan"),
    "VerifyReport": "_verify", "verify": "_verify",
    **dict.fromkeys(["FsspecStore", "LocalStore", "MemoryStore", "ObjectInfo", "Store",
                     "open_store"], "store"),
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Imports the module that defines public ``name`` on first use (PEP 562)."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'casstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # the names as static tools see them
    from ._async_save import AsyncCheckpointer as AsyncCheckpointer
    from ._copy import CopyInfo as CopyInfo
    from ._copy import copy as copy
    from ._copy_engine import CopyProgress as CopyProgress
    from ._errors import AccessDeniedError as AccessDeniedError
    from ._errors import CasstoreError as CasstoreError
    from ._errors import CorruptChunkError as CorruptChunkError
    from ._errors import ManifestError as ManifestError
    from ._errors import MissingChunkError as MissingChunkError
    from ._errors import ObjectNotFoundError as ObjectNotFoundError
    from ._errors import PersistError as PersistError
    from ._errors import ReadOnlyStoreError as ReadOnlyStoreError
    from ._errors import StepAlreadyExistsError as StepAlreadyExistsError
    from ._errors import StepNotFoundError as StepNotFoundError
    from ._errors import StoreTimeoutError as StoreTimeoutError
    from ._errors import StoreUnreachableError as StoreUnreachableError
    from ._errors import TargetMismatchError as TargetMismatchError
    from ._errors import TensorFileError as TensorFileError
    from ._errors import UnsupportedFormatError as UnsupportedFormatError
    from ._errors import UnsupportedLeafError as UnsupportedLeafError
    from ._export import ExportInfo as ExportInfo
    from ._export import ImportInfo as ImportInfo
    from ._export import check_export_path as check_export_path
    from ._export import export_tensors as export_tensors
    from ._export import import_tensors as import_tensors
    from ._fallback import FallbackStore as FallbackStore
    from ._gc import GcInfo as GcInfo
    from ._gc import gc as gc
    from ._inspect import LeafDiff as LeafDiff
    from ._inspect import LeafInfo as LeafInfo
    from ._inspect import StepInfo as StepInfo
    from ._inspect import diff_manifests as diff_manifests
    from ._inspect import diff_steps as diff_steps
    from ._inspect import inspect_step as inspect_step
    from ._inspect import manifest_as_dict as manifest_as_dict
    from ._locks import GcBusyError as GcBusyError
    from ._manager import CheckpointManager as CheckpointManager
    from ._manifest import ChunkRef as ChunkRef
    from ._manifest import LeafEntry as LeafEntry
    from ._manifest import Manifest as Manifest
    from ._orbax import OrbaxReadError as OrbaxReadError
    from ._orbax import UnsupportedItemError as UnsupportedItemError
    from ._orbax import import_orbax as import_orbax
    from ._policies import AnySavePolicy as AnySavePolicy
    from ._policies import ContinuousCheckpointingPolicy as ContinuousCheckpointingPolicy
    from ._policies import DecisionContext as DecisionContext
    from ._policies import FixedIntervalPolicy as FixedIntervalPolicy
    from ._policies import InitialSavePolicy as InitialSavePolicy
    from ._policies import PolicyCheckpointInfo as PolicyCheckpointInfo
    from ._policies import PreemptionCheckpointingPolicy as PreemptionCheckpointingPolicy
    from ._policies import PreservationContext as PreservationContext
    from ._policies import SaveDecisionPolicy as SaveDecisionPolicy
    from ._policies import SpecificStepsPolicy as SpecificStepsPolicy
    from ._preservation import AnyPreservationPolicy as AnyPreservationPolicy
    from ._preservation import BestN as BestN
    from ._preservation import CustomSteps as CustomSteps
    from ._preservation import EveryNSteps as EveryNSteps
    from ._preservation import LatestN as LatestN
    from ._preservation import PreservationPolicy as PreservationPolicy
    from ._preservation import PreserveAll as PreserveAll
    from ._repair import RepairInfo as RepairInfo
    from ._repair import repair as repair
    from ._repository import delete as delete
    from ._repository import latest_step as latest_step
    from ._repository import list_runs as list_runs
    from ._repository import list_steps as list_steps
    from ._repository import read_manifest as read_manifest
    from ._restore import restore as restore
    from ._save import SaveInfo as SaveInfo
    from ._save import save as save
    from ._scan import ManifestScan as ManifestScan
    from ._scan import Problem as Problem
    from ._scan import is_repository as is_repository
    from ._scan import scan_manifests as scan_manifests
    from ._target import PLACEHOLDER as PLACEHOLDER
    from ._target import abstract_tree as abstract_tree
    from ._usage import RepositoryUsage as RepositoryUsage
    from ._usage import RunUsage as RunUsage
    from ._usage import StepUsage as StepUsage
    from ._usage import object_sizes as object_sizes
    from ._usage import run_usage as run_usage
    from ._usage import step_usage as step_usage
    from ._usage import usage as usage
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
