#!/usr/bin/env python3
"""Puts the upstream transformers DeepSeek-V4.1 reference (R-HF, spec deepseek-v41.md §0.1) into the
reference venv. transformers 5.24.0 (the pinned release) has no `models/deepseek_v41`; upstream code
is never committed to this repository, so this script states exactly which files are used and how they
are put in place:

    python/.venv/bin/python python/install_v41_reference.py --src DIR     # files already downloaded
    python/.venv/bin/python python/install_v41_reference.py --fetch       # download (needs github)
    python/.venv/bin/python python/install_v41_reference.py --check       # verify what is installed

Files (huggingface/transformers, src/transformers/models/deepseek_v41/):
  modeling_deepseek_v41.py       at dfcfb777ee5bfaf80278369d556188b86d7e1b0b (the revision the spec reads)
  configuration_deepseek_v41.py  at f026c8315a275221a61e087edc3536f341e55f09 (unchanged at dfcfb77)
  __init__.py                    at dfcfb777ee5bfaf80278369d556188b86d7e1b0b
They are copied byte for byte (sha256 below) into <venv>/site-packages/transformers/models/deepseek_v41/.
The upstream `__init__.py` lists image-processing modules under TYPE_CHECKING only; they are not
installed (the lazy module only exposes the files present), nor is `modular_deepseek_v41.py` (not
imported at run time).

One adaptation of transformers 5.24.0 itself (the only one needed for the text model):
  cache_utils.get_layer_types_and_kwargs() passes `config=` to the cache-layer classes of
  "heavily_compressed_attention" / "compressed_sparse_attention" only; upstream registers the V4.1
  layer type "shared_compressed_attention" there too ("registered with the cache and masking
  utilities", upstream docs). Without it `DynamicCache(config=cfg)` raises
  `DeepseekV41CSACache.__init__() missing 1 required positional argument: 'config'`. The patch adds
  "shared_compressed_attention" to that tuple (one line, idempotent).

Nothing is registered with the Auto classes: the tooling imports
`transformers.models.deepseek_v41.{configuration,modeling}_deepseek_v41` directly (importing them prints
harmless "[ERROR] Config not found for deepseek-v41" auto-docstring messages).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import shutil
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

MODELING_COMMIT = "dfcfb777ee5bfaf80278369d556188b86d7e1b0b"
CONFIG_COMMIT = "f026c8315a275221a61e087edc3536f341e55f09"
UPSTREAM_DIR = "src/transformers/models/deepseek_v41"
# name -> (commit, sha256, characters); the character counts equal upstream's (checked when read).
FILES = {
    "__init__.py": (MODELING_COMMIT, "882b3e1b1f18d482405a5caee4c8670cbedeb7d14a78b6fb1db00792506a71fd", 1155),
    "configuration_deepseek_v41.py": (
        CONFIG_COMMIT, "fa31e747db62e4da82f1632a90cc07d2e1414b465c03baffc3b8e37ba86d2748", 30896),
    "modeling_deepseek_v41.py": (
        MODELING_COMMIT, "3c1f1579d763023bce14eeef77e8b3a054697e38490d1233a7dc625234258509", 149999),
}
PATCH_OLD = 'elif layer_type in ("heavily_compressed_attention", "compressed_sparse_attention"):'
PATCH_NEW = ('elif layer_type in ("heavily_compressed_attention", "compressed_sparse_attention", '
             '"shared_compressed_attention"):')


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def transformers_dir() -> str:
    import transformers

    return os.path.dirname(transformers.__file__)


def target_dir() -> str:
    return os.path.join(transformers_dir(), "models", "deepseek_v41")


def status() -> dict:
    """What is installed (recorded in every V4.1 fixture's meta.json)."""
    import transformers

    d = target_dir()
    files = {}
    for name, (commit, want, _) in FILES.items():
        p = os.path.join(d, name)
        got = sha256(p) if os.path.exists(p) else None
        files[name] = {"upstream_commit": commit, "sha256": got, "matches_pinned": got == want}
    with open(os.path.join(transformers_dir(), "cache_utils.py")) as f:
        patched = PATCH_NEW in f.read()
    return {
        "transformers_release": transformers.__version__,
        "deepseek_v41_source": f"huggingface/transformers@{MODELING_COMMIT} ({UPSTREAM_DIR}), "
        f"configuration at {CONFIG_COMMIT}",
        "files": files,
        "cache_utils_patch": "shared_compressed_attention passes config= (install_v41_reference.py)"
        if patched else "MISSING",
    }


def ok(st: dict) -> bool:
    return all(f["matches_pinned"] for f in st["files"].values()) and st["cache_utils_patch"] != "MISSING"


def patch_cache_utils() -> None:
    p = os.path.join(transformers_dir(), "cache_utils.py")
    with open(p) as f:
        s = f.read()
    if PATCH_NEW in s:
        return
    assert s.count(PATCH_OLD) == 1, "cache_utils.py is not the 5.24.0 one this patch was written for"
    with open(p, "w") as f:
        f.write(s.replace(PATCH_OLD, PATCH_NEW))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--src", help="directory holding the three upstream files")
    g.add_argument("--fetch", action="store_true", help="download them from raw.githubusercontent.com")
    g.add_argument("--check", action="store_true", help="only verify the installed files and the patch")
    a = ap.parse_args(argv)

    if not a.check:
        src = a.src
        if a.fetch:
            src = os.path.join(HERE, ".ref_hf")
            os.makedirs(src, exist_ok=True)
            for name, (commit, _, _) in FILES.items():
                url = f"https://raw.githubusercontent.com/huggingface/transformers/{commit}/{UPSTREAM_DIR}/{name}"
                print("fetching", url)
                urllib.request.urlretrieve(url, os.path.join(src, name))
        for name, (_, want, _) in FILES.items():
            got = sha256(os.path.join(src, name))
            if got != want:
                print(f"{name}: sha256 {got} != pinned {want}", file=sys.stderr)
                return 1
        d = target_dir()
        os.makedirs(d, exist_ok=True)
        for name in FILES:
            shutil.copyfile(os.path.join(src, name), os.path.join(d, name))
        for stale in glob.glob(os.path.join(d, "__pycache__", "*.pyc")):
            os.remove(stale)
        patch_cache_utils()
    st = status()
    for name, f in st["files"].items():
        print(f"{name:32s} {f['sha256']}  {'ok' if f['matches_pinned'] else 'MISMATCH'}")
    print("cache_utils patch:", st["cache_utils_patch"])
    return 0 if ok(st) else 1


if __name__ == "__main__":
    sys.exit(main())
