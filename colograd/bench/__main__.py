"""`python -m colograd.bench sync [--json]`: run one benchmark."""

import argparse
import importlib

BENCHMARKS = {"sync": "colograd.bench.sync"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m colograd.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions; medians are reported")
    args = parser.parse_args()
    importlib.import_module(BENCHMARKS[args.name]).run(repeats=args.repeats, as_json=args.json)


if __name__ == "__main__":
    main()
