"""Hydra discovers launchers in the `hydra_plugins` namespace package; ttrace's lives in
orchestrator/launcher.py (`hydra/launcher=ttrace`, the recipes' default)."""

from orchestrator.launcher import TtraceLauncher, TtraceLauncherConf  # noqa: F401  (registers the config)
