"""Files written whole or not at all: into `<path>.tmp`, then renamed over `path`.

A run killed mid-write (preempted, out of memory, Ctrl-C) leaves the previous file or
directory, or none, never half of one: `--resume` and the feature cache trust what they find.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Iterator


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def replacing(path: str) -> Iterator[str]:
    """Yields `path + ".tmp"` (cleared of any earlier attempt) to write a file or a directory
    into. On success it replaces `path` (a directory at `path` is removed first: `os.replace`
    cannot overwrite one); on an error it is removed and `path` is left as it was."""
    tmp = path + ".tmp"
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    os.replace(tmp, path)


def write_json(path: str, value) -> None:
    """`value` as indented JSON at `path`, atomically."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
