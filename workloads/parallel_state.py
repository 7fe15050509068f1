"""Mesh coordinates and process groups (Megatron order: rank = tp + tp_size*(dp + dp_size*pp))."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from workloads.config import ParallelConfig


def rank_of(tp: int, dp: int, pp: int, sizes: dict[str, int]) -> int:
    return tp + sizes["tp"] * (dp + sizes["dp"] * pp)


@dataclass
class ParallelState:
    rank: int
    sizes: dict[str, int]           # {"tp", "dp", "pp"}
    coords: dict[str, int]
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    mp_group: dist.ProcessGroup | None   # every TP and PP rank sharing this rank's dp index

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp: int) -> int:
        """Global rank of the same (tp, dp) coordinates on pipeline stage `pp` (the p2p peer)."""
        return rank_of(self.coords["tp"], self.coords["dp"], pp, self.sizes)


def initialize(parallel: ParallelConfig, rank: int, world_size: int) -> ParallelState:
    """Create every subgroup on every rank in the same order (dist.new_group is collective)."""
    tp, pp = parallel.tp, parallel.pp
    sizes = {"tp": tp, "dp": world_size // (tp * pp), "pp": pp}
    dp = sizes["dp"]
    coords = {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)}
    r = lambda t, d, p: rank_of(t, d, p, sizes)

    families = {
        "tp": [[r(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[r(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[r(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "mp": [[r(t, d, p) for p in range(pp) for t in range(tp)] for d in range(dp)],
    }
    mine: dict[str, dist.ProcessGroup | None] = {}
    for fam, groups in families.items():
        for ranks in groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[fam] = g
    return ParallelState(rank=rank, sizes=sizes, coords=coords, tp_group=mine["tp"], dp_group=mine["dp"],
                         pp_group=mine["pp"], mp_group=mine["mp"])
