"""python -m flashspec: the demo (flashspec/bench/demo.py)."""

from .bench.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
