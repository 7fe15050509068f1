"""The reduction block of stats mode (tracer/stats.py): a summarized tensor is reduced as dense rows of
BLOCK elements (zero-padded to whole blocks, which no statistic sees), and its snapshot takes whole
blocks of a slab (tracer/snapshot.py)."""

BLOCK = 128
