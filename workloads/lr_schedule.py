"""The built-in jobs' learning-rate schedule, counted in samples as Megatron's OptimizerParamScheduler:
`optim.lr` until step `optim.lr_decay_from`, then a linear decay to MIN_LR_RATIO x lr over
`optim.lr_decay_steps` steps (warmup-stable-decay without the warmup). `optim.lr_decay_from: null`
(the default) keeps the LR constant.

The scheduler is advanced after every optimizer step by the samples that step consumed: the global
batch (Megatron: num_microbatches x micro_batch_size x data_parallel_size). The step's LR follows from
the samples consumed before it.
"""

from __future__ import annotations

from typing import Any

from workloads.config import Config

MIN_LR_RATIO = 0.1   # the LR at the end of the decay, relative to optim.lr (Megatron's min_lr)


def lr_at(cfg: Config, consumed_samples: int) -> float:
    """The LR once `consumed_samples` samples have been trained on."""
    if cfg.lr_decay_from is None:
        return cfg.lr
    start, gb = cfg.lr_decay_from * cfg.global_batch, cfg.global_batch
    if consumed_samples < start:
        return cfg.lr
    done = min(1.0, (consumed_samples - start + gb) / (cfg.lr_decay_steps * gb))   # the step at start: 1
    return cfg.lr * (1.0 - (1.0 - MIN_LR_RATIO) * done)


class Scheduler:
    """The LR of every step: `set` before the optimizer step, `step(increment)` after it."""

    def __init__(self, cfg: Config):
        self.cfg, self.consumed = cfg, 0

    def set(self, optimizer: Any) -> float:
        lr = lr_at(self.cfg, self.consumed)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self, increment: int) -> None:
        self.consumed += increment
