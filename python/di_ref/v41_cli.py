"""`python -m di_ref.v41_cli logits --model DIR --tokens 1,2,3 --out X.npy`: the C CLI's `logits`
interface on top of R-HF V4.1 (hf/ layout directories written by di_ref/v41.py only). Lets
check_unseen.py --arch v41 be tested without the C engine; it is the reference, not an implementation.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["logits"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from . import v41

    model = v41.load_dir(a.model)
    ids = torch.tensor([int(t) for t in a.tokens.split(",")])
    cap = v41.run(model, ids, gaps=False)
    np.save(a.out, cap["logits"].numpy().astype(np.float32))
    return 0


if __name__ == "__main__":
    sys.exit(main())
