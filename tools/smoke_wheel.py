"""Smoke test of an installed wheel: ``make wheel-smoke`` runs it in a fresh virtualenv.

Run from outside the source tree, so that ``import planner`` finds the installed package and not
the checkout. Checks what a user's first ``pip install`` depends on: the distribution's name and
version, the typing marker, and that a plan of the zoo GPT trains with identical gradients
(``planner.demo`` compares every gradient and the measured peak with the budget).
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

DISTRIBUTION = "torch-activation-planner"


def main() -> int:
    import planner
    from planner import demo

    location = Path(planner.__file__).resolve().parent
    problems = []
    if Path(sys.prefix).resolve() not in location.parents:
        problems.append(f"planner was imported from {location}, not from the virtualenv")
    if version(DISTRIBUTION) != planner.__version__:
        problems.append(
            f"{DISTRIBUTION} {version(DISTRIBUTION)} installed, planner.__version__ "
            f"is {planner.__version__}"
        )
    if not (location / "py.typed").is_file():
        problems.append("the wheel lacks planner/py.typed")
    for problem in problems:
        print(f"smoke test: {problem}", file=sys.stderr)
    print(f"{DISTRIBUTION} {planner.__version__} from {location}")
    status = demo.main(["--layers", "2", "--d-model", "64", "--seq", "64", "--batch", "2"])
    return 1 if problems or status else 0


if __name__ == "__main__":
    sys.exit(main())
