"""Which weights a model directory holds, without reading them all.

Records are captured from one set of weights; training against another (a fine-tune of the same
architecture and tokenizer, put at model.path or over the old files) gives a drafter that predicts
a model nobody serves, and nothing else notices: shapes, tokenizer and layer ids all still agree.

The id hashes config.json and, per weight file, its name, its size and a few blocks spread over it.
A copy or a move keeps the id; a fine-tune changes the bytes almost everywhere, so some block of it
differs. Reading all the weights would be exact but costs minutes on a target of hundreds of GB;
this reads SAMPLES * BLOCK bytes per file.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLES = 16
BLOCK = 16 << 10


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in Path(model_dir).iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())


def weights_id(model_dir: str | os.PathLike) -> str | None:
    """A short hex id of the weights in `model_dir`; None when it holds no weight file (nothing to
    compare). OSError when a file cannot be read. Remembered while no file's inode, size or mtime
    changes: a poll may ask every second."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        return None
    stats = [_stat(p) for p in [model_dir / "config.json", *files]]
    key = (str(model_dir.resolve()), tuple(stats))
    if key in _REMEMBERED:
        return _REMEMBERED[key]
    found = _sampled_id(model_dir, files)
    # File times are coarse (a jiffy): a rewrite within the tick of this read would keep its key.
    if all(time.time_ns() - mtime > RACY_S * 1e9 for _, _, _, mtime in stats):
        if len(_REMEMBERED) >= 16:
            _REMEMBERED.pop(next(iter(_REMEMBERED)))
        _REMEMBERED[key] = found
    return found


def readable_weights_id(model_dir: str | os.PathLike) -> str | None:
    """weights_id, or None when the directory cannot be read: for comparisons that leave an unreadable
    model.path to the `model` stage, which names it."""
    try:
        return weights_id(model_dir)
    except OSError:
        return None


_REMEMBERED: dict[tuple, str] = {}
RACY_S = 2.0


def _stat(path: Path) -> tuple[str, int, int, int]:
    try:
        st = path.stat()
    except FileNotFoundError:
        return (path.name, 0, -1, 0)
    return (path.name, st.st_ino, st.st_size, st.st_mtime_ns)


def _sampled_id(model_dir: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in files:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(f"\0{path.name}\0{size}\0".encode())
            for offset in _offsets(size):
                handle.seek(offset)
                digest.update(handle.read(BLOCK))
    return digest.hexdigest()[:16]


def _offsets(size: int) -> list[int]:
    if size <= SAMPLES * BLOCK:
        return list(range(0, size, BLOCK))  # small file: all of it
    last = size - BLOCK
    return [last * i // (SAMPLES - 1) for i in range(SAMPLES)]


WEIGHTS_FIX = ("point model.path back at the weights the run was captured from, or set extract.run to a new name "
               "and extract again for this model (the old records are kept until you release them)")


def weights_mismatch(run_meta: dict, model_dir: str | os.PathLike, current: str | None) -> str | None:
    """What differs between the weights a run's records were captured from (its run.json) and the
    weights at `model_dir` (id `current`); None when they match or either side has no id (runs from
    before the id, or a model directory without weight files)."""
    recorded = run_meta.get("model_weights")
    if recorded is None or current is None or recorded == current:
        return None
    if str(run_meta.get("model")) == str(model_dir):
        return (f"its records were captured from weights {recorded}, but the files at model.path {model_dir} "
                f"now hold weights {current} (replaced since)")
    return (f"its records were captured from weights {recorded} ({run_meta.get('model')}), but model.path "
            f"{model_dir} holds weights {current}")
