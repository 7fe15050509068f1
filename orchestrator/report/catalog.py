"""`ttrace bugs`: the catalog of injectable silent bugs (workloads/bugs.py), one line each."""

from __future__ import annotations

import shlex
import sys

from rich.console import Console
from rich.table import Table


def main(argv: list[str]) -> int:
    from workloads.bugs import CATALOG

    if argv and argv[0] in ("-h", "--help"):
        print("usage: ttrace bugs [NAME]   list the bug catalog, or show one entry in full")
        return 0
    if argv:
        bug = CATALOG.get(argv[0])
        if bug is None:
            print(f"ttrace bugs: no bug named '{argv[0]}'; `ttrace bugs` lists them", file=sys.stderr)
            return 2
        fields = ("name", "job", "bugs_md", "mechanism", "needs", "trigger", "reference", "expect",
                  "localize", "source") + (("first_step", "late", "early") if bug.is_late else ())
        for field in fields:
            print(f"{field:>10}: {getattr(bug, field)}")
        print(f"\n  run it:  ttrace {' '.join(shlex.quote(o) for o in bug.recipe)} bug={bug.name}")
        if bug.is_late:
            print(f"  (a late bug: that recipe moves it to step 1; at its real step {bug.first_step}, "
                  f"{' '.join(bug.late)}, only a run of more than {bug.first_step} steps meets it)")
        return 0
    title = f"ttrace bug catalog ({len(CATALOG)} switches; `ttrace bugs NAME` for one)"
    columns = ("#", "bug", "trigger recipe", "must localize at", "mechanism")
    rows = [(str(b.bugs_md or "-"), b.name, " ".join(b.recipe), b.expect, b.mechanism)
            for b in sorted(CATALOG.values(), key=lambda b: (b.job != "builtin", b.bugs_md, b.name))]
    if not sys.stdout.isatty():   # a pipe or a file: one tab-separated line per bug, never wrapped
        print("\t".join(columns))
        for row in rows:
            print("\t".join(row))
        return 0
    table = Table(title=title)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    return 0
