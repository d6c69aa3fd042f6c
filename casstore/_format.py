"""Format features and the reader's version gate (format.md §2.1, §4.1 and §10).

The config object and each manifest list the format features they use and the oldest casstore
that reads them (``features``, ``min_reader``). A reader checks both before it reads a chunk:
a feature it does not know, or a ``min_reader`` above :data:`READER_VERSION`, raises
:class:`~casstore.UnsupportedFormatError` naming it and the casstore version that reads it.
Objects written before these fields existed have neither and use no feature unknown to a
reader of this version (format.md §10).
"""

from __future__ import annotations

import re
from typing import Any

from ._errors import ManifestError, UnsupportedFormatError

# The casstore release whose format this code reads and writes. Bump it with the release that
# first writes a new feature, and add the feature to FEATURES with it.
READER_VERSION = "0.1.0"
# Feature name -> the first casstore release that reads it (format.md §10). A writer never
# reuses a name, as it never reuses a codec number.
FEATURES = {
    "codec-5": "0.1.0",  # chunks in byte planes with the sign moved below the exponent, §3.2
    "pack": "0.1.0",  # small leaves packed into one chunk, §3.4
    "delta": "0.1.0",  # delta chunks under deltas/, chunk refs with a base, §3.5
}
FIRST_RELEASE = "0.1.0"  # reads every object that lists no feature
MAX_FEATURES = 64
_VERSION = re.compile(r"\d{1,6}(\.\d{1,6}){0,3}")


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.10.2"`` as ``(0, 10, 2)``, for ordering release numbers."""
    return tuple(int(part) for part in version.split("."))


def min_reader(features: list[str]) -> str:
    """The oldest casstore release that reads every feature of ``features`` (names of
    :data:`FEATURES`); :data:`FIRST_RELEASE` for none."""
    return max((FEATURES[f] for f in features), key=version_tuple, default=FIRST_RELEASE)


def check_features(fields: dict, **where: Any) -> None:
    """Checks the ``features`` and ``min_reader`` fields of a decoded config object or manifest
    (either may be absent: an object written before them).

    Args:
      fields: the decoded msgpack map.
      where: ``url``, ``run``, ``step`` for the error.

    Raises:
      UnsupportedFormatError: a feature this reader does not know, with a ``min_reader``
        above :data:`READER_VERSION`, or such a ``min_reader``; names it and the version that
        reads it.
      ManifestError: the fields are of the wrong type or form, or a feature this reader does
        not know comes without a ``min_reader`` above its own (damage, not a newer format:
        a newer writer's feature always names a newer release).
    """
    features, needs = fields.get("features", []), fields.get("min_reader")
    if not (isinstance(features, list) and len(features) <= MAX_FEATURES
            and all(isinstance(f, str) and len(f) <= 64 for f in features)):
        raise ManifestError(f"invalid format: bad features list {features!r}", **where)
    if needs is not None and not (isinstance(needs, str) and _VERSION.fullmatch(needs)):
        raise ManifestError(f"invalid format: bad min_reader {needs!r}", **where)
    unknown = [f for f in features if f not in FEATURES]
    if unknown and (needs is None or version_tuple(needs) <= version_tuple(READER_VERSION)):
        # a newer writer's feature comes with a min_reader above this release: this is damage
        raise ManifestError(f"invalid format: unknown feature {unknown[0]!r}, which "
                            f"min_reader {needs} says this casstore ({READER_VERSION}) reads: "
                            "damaged", **where)
    if unknown:
        raise UnsupportedFormatError(f"feature {unknown[0]!r}", needs=needs,
                                     reader=READER_VERSION, **where)
    if needs is not None and version_tuple(needs) > version_tuple(READER_VERSION):
        raise UnsupportedFormatError(f"min_reader {needs}", needs=needs, reader=READER_VERSION,
                                     **where)


def unsupported_version(what: str, version: object, known: int, **where: Any) -> None:
    """Raises for a ``version`` field outside ``1..known``: :class:`UnsupportedFormatError` for
    an int above ``known`` (a newer format), else :class:`ManifestError` (damage). ``what``
    names the field in the message, e.g. ``"version"`` or ``"repository version"``."""
    if isinstance(version, int) and not isinstance(version, bool) and version > known:
        raise UnsupportedFormatError(f"{what} {version}", needs=None, reader=READER_VERSION,
                                     **where)
    if not (isinstance(version, int) and not isinstance(version, bool) and version >= 1):
        raise ManifestError(f"invalid format: bad {what} {version!r}", **where)
