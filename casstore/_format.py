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
_VERSION = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6}){0,3}")


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
        above :data:`READER_VERSION`; names it and the version that reads it (a
        ``min_reader`` above it alone: :func:`check_min_reader`).
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
    if unknown:
        unknown_to_reader(f"feature {unknown[0]!r}", needs, **where)


def check_min_reader(fields: dict, **where: Any) -> None:
    """Raises UnsupportedFormatError if the ``min_reader`` of ``fields`` (checked by
    :func:`check_features`) names a release above this one. Called after the checks that
    name what is newer (a feature, version or hash), as a last gate."""
    needs = fields.get("min_reader")
    if needs is not None and version_tuple(needs) > version_tuple(READER_VERSION):
        raise UnsupportedFormatError(f"min_reader {needs}", needs=needs, reader=READER_VERSION,
                                     **where)


def unknown_to_reader(what: str, needs: str | None, **where: Any) -> None:
    """Raises for ``what`` (a feature, version or hash) this reader does not know, in an object
    whose ``min_reader`` is ``needs``: :class:`UnsupportedFormatError` if ``needs`` names a
    newer release, else :class:`ManifestError`: a newer writer's change always comes with a
    newer ``min_reader`` (format.md §10), so under one this release meets (or none) the
    unknown value is damage, which an upgrade would not mend."""
    if needs is not None and version_tuple(needs) > version_tuple(READER_VERSION):
        raise UnsupportedFormatError(what, needs=needs, reader=READER_VERSION, **where)
    raise ManifestError(f"invalid format: unknown {what}, under min_reader {needs} (this "
                        f"casstore is {READER_VERSION}): damaged", **where)


def unsupported_version(what: str, version: object, known: int, needs: Any = None,
                        **where: Any) -> None:
    """Raises for a ``version`` field outside ``1..known``: for an int above ``known``, as
    :func:`unknown_to_reader` says for the object's ``min_reader`` ``needs`` (a newer format,
    or damage), else :class:`ManifestError` (damage). ``what`` names the field in the message,
    e.g. ``"version"`` or ``"repository version"``."""
    if isinstance(version, int) and not isinstance(version, bool) and version > known:
        unknown_to_reader(f"{what} {version}", needs if isinstance(needs, str) else None,
                          **where)
    if not (isinstance(version, int) and not isinstance(version, bool) and version >= 1):
        raise ManifestError(f"invalid format: bad {what} {version!r}", **where)
