"""`python -m autopar show|explain|diff|html PLAN.json ...`: read saved plans from the shell.

  show PLAN.json             every input's spec, the predicted cost and memory (summary())
  explain PLAN.json PATH     one input: its spec, bytes and reshardings (a saved plan cannot
                             search again: plan the step in Python for the alternatives)
  diff A.json B.json         the inputs sharded differently and what each plan predicts
  html PLAN.json OUT.html    the plan as one self-contained page (Plan.to_html)
"""
from __future__ import annotations

import argparse
import sys

from autopar.errors import AutoparError
from autopar.plan import load_plan
from autopar.plan_diff import diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="a plan's inputs, cost and memory")
    show.add_argument("plan")
    show.add_argument("--limit", type=int, default=40, help="reshardings listed at most")
    explain = commands.add_parser("explain", help="one input of a plan")
    explain.add_argument("plan")
    explain.add_argument("path")
    compare = commands.add_parser("diff", help="two plans compared")
    compare.add_argument("a")
    compare.add_argument("b")
    page = commands.add_parser("html", help="a plan as one HTML page")
    page.add_argument("plan")
    page.add_argument("out")
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            print(load_plan(args.plan).summary(args.limit))
        elif args.command == "explain":
            print(load_plan(args.plan).explain(args.path))
        elif args.command == "html":
            load_plan(args.plan).to_html(args.out, title=args.plan)
            print(f"wrote {args.out}")
        else:
            print(diff(load_plan(args.a), load_plan(args.b)))
    except AutoparError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
