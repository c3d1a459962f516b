"""``s2hc study CONFIG --out DIR``: a grid of families, stream counts and seeds, trained alike, and a report.

Exit status: 0 when every run finished or diverged (recorded) and the report is written; 2 for bad input (an
unknown key, family or option, an empty grid, a DIR of another study or in use); 1 when a run failed (the
others are kept: run the same command again); 128 + N after signal N (the runs saved checkpoints first).
"""

from __future__ import annotations

import argparse
import sys

from .common import positive_int

# s2hc.study is imported by run (s2hc.cli's start time).

SUMMARY = {"study": "train a grid of families × streams × seeds and report with statistics"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "study", help=SUMMARY["study"],
        description="Train every configuration of the grid in CONFIG (a YAML file, or the name of a shipped one: "
        "`s2hc study study-smoke --out runs/study-smoke`; `s2hc configs` lists them) for every seed, "
        "each as an ordinary run directory under DIR/runs/, then write DIR/results.json and DIR/report.md "
        "(means, 95 % intervals, paired tests against the baselines, the trained matrices, figures). Calling it "
        "again finishes an interrupted study; a finished one is left as it is.",
    )
    parser.add_argument("config", nargs="?", metavar="CONFIG",
                        help="the study's YAML grid, or a shipped one's name such as study-smoke (a file of that name "
                        "here comes first); not with --report-only")
    parser.add_argument("--out", required=True, metavar="DIR", help="the study's directory")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="runs at a time (one GPU each where there are GPUs; on a CPU, the cores shared); "
                        "default 1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a training setting of every run, e.g. max_steps=50 (repeatable)")
    parser.add_argument("--logger", default=None, metavar="A,B",
                        help="experiment loggers of every run besides metrics.jsonl: csv, tensorboard, wandb, mlflow "
                        "(the same as --set logger=A,B; tensorboard/wandb/mlflow write into DIR, grouped by its name)")
    parser.add_argument("--device", default="auto", help="where the trained models are measured (default auto)")
    parser.add_argument("--print-commands", action="store_true",
                        help="write the run configs and print the `s2hc train` command of every unfinished run, for a "
                        "scheduler; then call the study again to measure them and write the report")
    parser.add_argument("--report-only", action="store_true", help="rebuild DIR/report.md from DIR/results.json alone")
    parser.add_argument("--new-registration", action="store_true",
                        help="the config's preregistered test differs from the one DIR/study.json recorded and runs "
                        "exist: record it as a new registration made after those runs (the report says so; without "
                        "this flag the study refuses)")
    parser.set_defaults(func=run, subparser=parser)


def run(args: argparse.Namespace) -> int:
    from ..config import config_path
    from ..study import StudyFailed, StudyInterrupted, print_commands, run_study, write_report
    from ..study.spec import parse_spec
    from .configs import read_config

    if args.report_only:
        if args.config or args.set or args.print_commands or args.logger or args.new_registration:
            args.subparser.error("--report-only reads DIR/results.json alone: drop CONFIG, --set, --logger, "
                                 "--new-registration and --print-commands")
        print(f"Report: {write_report(args.out)}")
        return 0
    if args.config is None:
        args.subparser.error("CONFIG is required (the study's YAML grid), unless --report-only")
    overrides = [*args.set, *([f"logger={args.logger}"] if args.logger is not None else [])]
    values, source = read_config(args.config, "study")
    spec = parse_spec(values, overrides, source=source)
    path = config_path(args.config)  # where the commit is read when s2hc is not a checkout (an installed package)
    if args.print_commands:
        commands = print_commands(spec, args.out, config=path, new_registration=args.new_registration)
        print("\n".join(commands) if commands else "# every run is finished")
        print(f"# then: s2hc study {args.config} --out {args.out}   (measures the runs and writes the report)")
        return 0
    try:
        report = run_study(spec, args.out, jobs=args.jobs, device=args.device, config=path,
                           new_registration=args.new_registration)
    except StudyInterrupted as error:
        print(f"s2hc study: {error}", file=sys.stderr)
        return 128 + error.signum
    except StudyFailed as error:
        print(f"s2hc study: {error}", file=sys.stderr)
        return 1
    print(f"Report: {report}")
    return 0
