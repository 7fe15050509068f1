"""Framework-specific helpers for the tracer (imported explicitly: each needs its library).

`tracer.frameworks.dtensor`: layouts from DTensor placements (torch-native TP/SP/FSDP2, HF TP);
`tracer.frameworks.hf`: output layouts of transformers' TP styles.
"""
