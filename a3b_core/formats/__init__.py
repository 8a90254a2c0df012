"""Weight formats: how a matrix or a stack of routed experts is held (float, FP8 blocks, int8 rows, int4 groups) and
how its products are computed."""
