"""Mesh coordinates and process groups (Megatron order tp-cp-dp-pp:
rank = tp + tp_size*(cp + cp_size*(dp + dp_size*pp)); cp_size is 1 unless context parallelism is on)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from workloads.config import ParallelConfig


def rank_of(tp: int, dp: int, pp: int, sizes: dict[str, int], cp: int = 0) -> int:
    return tp + sizes["tp"] * (cp + sizes.get("cp", 1) * (dp + sizes["dp"] * pp))


@dataclass
class ParallelState:
    rank: int
    sizes: dict[str, int]           # {"tp", "dp", "pp"}
    coords: dict[str, int]
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    mp_group: dist.ProcessGroup | None   # every TP and PP rank sharing this rank's dp (and cp) index
    cp_group: dist.ProcessGroup | None = None   # context parallelism: ranks holding this sequence's chunks
    # TP x CP: the ranks holding pieces of one microbatch's activations (FP8 amax reduction group, as
    # Megatron's amax reduction group includes CP: each CP rank sees only its sequence chunks).
    tp_cp_group: dist.ProcessGroup | None = None

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
        return rank_of(self.coords["tp"], self.coords["dp"], pp, self.sizes, self.coords.get("cp", 0))

    @property
    def cp_size(self) -> int:
        return self.sizes.get("cp", 1)


def initialize(parallel: ParallelConfig, rank: int, world_size: int) -> ParallelState:
    """Create every subgroup on every rank in the same order (dist.new_group is collective)."""
    tp, pp, cp = parallel.tp, parallel.pp, parallel.cp
    sizes = {"tp": tp, "dp": world_size // (tp * pp * cp), "pp": pp}
    dp = sizes["dp"]
    coords = {"tp": rank % tp, "dp": (rank // (tp * cp)) % dp, "pp": rank // (tp * cp * dp)}
    if cp > 1:   # the cp axis exists only when it is used (traces of other layouts keep their mesh)
        sizes["cp"], coords["cp"] = cp, (rank // tp) % cp
    r = lambda t, d, p, c=0: rank_of(t, d, p, sizes, c)
    C = range(cp)

    families = {
        "tp": [[r(t, d, p, c) for t in range(tp)] for p in range(pp) for d in range(dp) for c in C],
        "dp": [[r(t, d, p, c) for d in range(dp)] for p in range(pp) for t in range(tp) for c in C],
        "pp": [[r(t, d, p, c) for p in range(pp)] for d in range(dp) for t in range(tp) for c in C],
        "mp": [[r(t, d, p, c) for p in range(pp) for t in range(tp)] for d in range(dp) for c in C],
        "cp": [[r(t, d, p, c) for c in C] for p in range(pp) for d in range(dp) for t in range(tp)],
        "tp_cp": [[r(t, d, p, c) for c in C for t in range(tp)] for p in range(pp) for d in range(dp)],
    }
    mine: dict[str, dist.ProcessGroup | None] = {}
    for fam, groups in families.items():
        for ranks in groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[fam] = g
    return ParallelState(rank=rank, sizes=sizes, coords=coords, tp_group=mine["tp"], dp_group=mine["dp"],
                         pp_group=mine["pp"], mp_group=mine["mp"], cp_group=mine["cp"],
                         tp_cp_group=mine["tp_cp"])
