"""``s2hc study``: a grid of families × stream counts × seeds trained alike, with statistics and a report.

- :mod:`~s2hc.study.spec`: the YAML grid, checked whole before anything runs (:func:`load_spec`).
- :mod:`~s2hc.study.runner`: each run an ordinary ``s2hc train`` process, ``jobs`` at a time, resumable
  (:func:`run_study`, :func:`print_commands`).
- :mod:`~s2hc.study.measure`: one run into one row of ``results.json`` (:func:`measure_run`).
- :mod:`~s2hc.study.stats`: Student-t intervals, paired t-tests, Holm's correction.
- :mod:`~s2hc.study.report`: ``report.md`` and figures from ``results.json`` alone (:func:`write_report`).
- :mod:`~s2hc.study.comparison`: ``s2hc compare``, a study with one axis (families × seeds) (:func:`compare`).
"""

from .comparison import compare, compare_spec
from .report import write_report
from .runner import StudyFailed, StudyInterrupted, print_commands, run_study
from .spec import Configuration, StudySpec, load_spec, parse_spec

__all__ = [
    "Configuration",
    "StudyFailed",
    "StudyInterrupted",
    "StudySpec",
    "compare",
    "compare_spec",
    "load_spec",
    "parse_spec",
    "print_commands",
    "run_study",
    "write_report",
]
