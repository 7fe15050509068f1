"""Live display of a sweep's jobs (rich, on stderr) when enabled; one log line per change when
stderr is not a terminal."""

from __future__ import annotations

import sys

from orchestrator import cluster


class JobProgress:
    """Live display of the sweep's jobs (rich, on stderr) when enabled; a no-op callback otherwise."""

    def __init__(self, enabled: bool):
        self.enabled, self.live, self.last = enabled, None, ""

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        if console.is_terminal:
            self.live = Live(console=console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self.update

    def update(self, jobs: list[cluster.Job]) -> None:
        from rich.table import Table

        counts = {s: sum(j.state == s for j in jobs) for s in ("queued", "running", "done", "failed")}
        line = (f"ttrace jobs: {counts['queued']} queued, {counts['running']} running, "
                f"{counts['done']} done, {counts['failed']} failed")
        if self.live is None:      # not a terminal (cron, CI, a pipe): one log line per change
            if line != self.last:
                print(line, file=sys.stderr, flush=True)
            self.last = line
            return
        table = Table(title=line, title_justify="left")
        for col in ("for", "job", "ranks", "state"):
            table.add_column(col)
        for j in [j for j in jobs if j.state == "running"][:12]:
            table.add_row(j.label, j.name, str(j.world_size), "[cyan]running")
        for j in [j for j in jobs if j.state == "failed"][:5]:
            table.add_row(j.label, j.name, str(j.world_size), "[red]failed")
        self.live.update(table)

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
        return False
