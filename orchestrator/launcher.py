"""`hydra/launcher: ttrace`: a sweep's checks run as one batch on one Ray cluster.

Hydra's sweeper hands the launcher every job of a sweep at once (`launch`). Each job is set up the way
Hydra's basic launcher does it (its composed recipe, its output directory with `.hydra/`, callbacks),
then all of them run together through `orchestrator.check.run_checks`: distinct references are
computed once, and every job starts as soon as the cluster has room for all its ranks. Each job's
`JobReturn.return_value` is its CheckResult.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class TtraceLauncherConf:
    _target_: str = "hydra_plugins.ttrace_launcher.ttrace_launcher.TtraceLauncher"
    progress: bool = True   # live display of the jobs on stderr


ConfigStore.instance().store(group="hydra/launcher", name="ttrace", node=TtraceLauncherConf,
                             provider="ttrace")


# Every CheckResult this process finished, in order: `ttrace` exits with the worst of them (Hydra's
# entry point hands neither a run's nor a sweep's returns back to its caller).
completed: list[Any] = []


class BatchLauncher(Launcher):
    """The launcher itself; Hydra instantiates its subclass in hydra_plugins/ (it accepts plugin
    classes defined there only)."""

    def __init__(self, progress: bool = True) -> None:
        super().__init__()
        self.progress = progress
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from orchestrator.check import run_checks
        from orchestrator.console import emit
        from orchestrator.recipe import to_dict

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        planned: list[tuple[dict[str, Any], Path]] = []
        returns: list[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            # Hydra's per-job setup (output dir, .hydra/ configs, callbacks); the job itself is only
            # its composed recipe and directory until every job of the sweep is known.
            ret = run_job(hydra_context=self.hydra_context, config=cfg, job_dir_key="hydra.sweep.dir",
                          job_subdir_key="hydra.sweep.subdir",
                          task_function=lambda c: (to_dict(c), Path(HydraConfig.get().runtime.output_dir)))
            if ret.status != JobStatus.COMPLETED:
                raise ret.return_value   # the recipe could not be composed: Hydra reports it
            planned.append(ret.return_value)
            returns.append(ret)
        results = run_checks(planned, str(self.config.hydra.runtime.cwd), progress=self.progress)
        for ret, result in zip(returns, results, strict=True):
            emit(result)
            completed.append(result)
            ret.return_value = result
        return returns
