"""``python -m s2hc``: the ``s2hc`` command."""

from .cli import main
from .train.processes import die_with_parent

if __name__ == "__main__":
    die_with_parent()  # a run started by `s2hc study` dies with the study, even one killed with kill -9
    raise SystemExit(main())
