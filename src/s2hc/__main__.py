"""``python -m s2hc``: the ``s2hc`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
