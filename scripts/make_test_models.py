"""Write the tiny random-weight test models to disk.

    python scripts/make_test_models.py --out /tmp/mlxkv-test-models            # every architecture
    python scripts/make_test_models.py --out DIR --arch llama --arch gemma3_text --seed 1

Each model lands in DIR/<arch>/ and loads with ``mlx_lm.utils.load`` (or ``mlxkv generate --model``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from testkit.archs import ARCH_NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("test_models"), help="output folder (default: ./test_models)")
    parser.add_argument(
        "--arch", action="append", choices=ARCH_NAMES, help="architecture to write (repeatable; default: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    args = parser.parse_args(argv)

    from testkit.models import write_test_model

    for arch in args.arch or ARCH_NAMES:
        path = write_test_model(arch, args.out / arch, seed=args.seed)
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"{arch:12s} -> {path}  ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testkit
    sys.exit(main())
