"""``python -m s2hc.evaluate ARGS``: lm-eval's command line (``lm_eval ARGS``) with s2hc registered.

The model ``s2hc`` (``--model s2hc --model_args checkpoint=PATH``) is registered and, unless ``--include_path``
is given, the shipped offline tasks (``s2hc_nextline``, ``s2hc_ppl``, ``s2hc_offline``) are included. Everything
else is lm-eval's own CLI, unchanged. This exists because lm-eval 0.4.x finds models only in its own
registry; an lm-eval that reads the ``lm_eval.models`` entry point group finds ``s2hc`` with plain ``lm_eval``.
"""

from __future__ import annotations

import sys

from ..extras import MissingExtra, require


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cli_evaluate = require("lm_eval.__main__", "python -m s2hc.evaluate").cli_evaluate
    except MissingExtra as error:
        sys.exit(str(error))
    from . import harness  # noqa: F401 - registers the model "s2hc"
    from .offline import tasks_dir

    if not any(a == "--include_path" or a.startswith("--include_path=") for a in argv) and argv[:1] not in (
        ["-h"], ["--help"], [],
    ):  # fmt: skip
        argv += ["--include_path", str(tasks_dir())]
    sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":  # pragma: no cover
    main()
