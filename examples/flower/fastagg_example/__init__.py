"""A Flower app whose server aggregates with fastagg.flower (see ../README.md)."""
