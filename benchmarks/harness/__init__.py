# ruff: noqa: F401  (this module re-exports the harness's names)
"""What every benchmark shares; each benchmark script holds only its scenario and imports this
package by path (``benchmarks/`` is scripts, not a package): ``import harness as h``.

- :mod:`.states`: the GPT-2-shaped train states and the bit-exact checks;
- :mod:`.timing`: a timed phase (wall, CPU, disk reads, peak RSS, cache drop, memory warming),
  systems interleaved across repeats, medians;
- :mod:`.peers`: casstore, orbax, safetensors and plain s3fs behind one interface;
- :mod:`.limit`: the machine's limit measured in the same run;
- :mod:`.storage`: scratch directories, sizes on disk, an S3 server;
- :mod:`.report`: tables, targets, JSON, plots and the shared command line.
"""

from . import limit, peers
from .report import (
    environment,
    figure_table,
    fmt,
    limit_lines,
    machine_note,
    md_table,
    parse,
    parser,
    ratio,
    report,
    target_lines,
)
from .states import (
    CHANGED_BLOCKS,
    SIZES,
    abstract_of,
    changed_state,
    changed_zstd_bytes,
    check,
    device,
    flatten,
    same_bytes,
    state_bytes,
    to_jax,
    train_state,
    verify_equal,
)
from .storage import (
    HERE,
    du,
    load_module,
    new_bucket,
    rclone_copy,
    rclone_env,
    s3_server,
    scratch,
)
from .timing import (
    PeakRss,
    interleave,
    medians,
    phase,
    rotated,
    seconds,
    settle,
)
