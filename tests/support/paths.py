"""Where things are: the repository's root, for tests and the GPU kit that read its files."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
