"""Shared setup of the llama.cpp reference scripts: paths, command line and the model checksum.

Imported by the scripts next to it (run as `python3 scripts/reference/X.py` from the
repository root, which puts this directory on `sys.path`). Standard library only.
"""

import argparse
import hashlib
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.expanduser("~/.cache/kvdb/models/gemma-3-270m-q4_k_m.gguf")
GPL_PATH = "tests/data/gpl-3.txt"  # relative to the repository root


def golden_path(name):
    """Where the golden file `name` lives: model/tests/data/ in the repository."""
    return os.path.join(REPO, "model", "tests", "data", name)


def parse_args(doc, default_out):
    """`--model` (default `$KVDB_MODEL`, else DEFAULT_MODEL) and `--out`; `doc`'s first line
    describes the script."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default=os.environ.get("KVDB_MODEL", DEFAULT_MODEL))
    ap.add_argument("--out", default=default_out)
    return ap.parse_args()


def read_gpl():
    """The text of GPL_PATH."""
    with open(os.path.join(REPO, GPL_PATH), encoding="utf-8") as f:
        return f.read()


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
