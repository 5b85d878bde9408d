"""Command line: ``python -m fxfuse demo [--steps N ...]``."""
import sys


def _main() -> int:
    args = sys.argv[1:]
    if not args or args[0] not in ("demo",):
        print("usage: python -m fxfuse demo [--steps N] [--batch B] [--seq S] [--vocab V] [--device D]")
        return 2
    from .demo import main

    return main(args[1:])


if __name__ == "__main__":
    sys.exit(_main())
