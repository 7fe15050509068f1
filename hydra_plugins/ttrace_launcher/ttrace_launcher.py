"""Hydra accepts launchers defined in the `hydra_plugins` namespace package only; ttrace's is
orchestrator/launcher.py (`hydra/launcher: ttrace`, the recipes' default)."""

from orchestrator.launcher import BatchLauncher


class TtraceLauncher(BatchLauncher):
    """`hydra/launcher: ttrace` (orchestrator.launcher.BatchLauncher)."""
