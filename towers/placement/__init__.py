"""Where variables and optimizer state live, and where their updates run.

columns (`Columns`: the model's variables in columns, each with its device: a
pipeline stage's, a split layer part's, or with spread placement each tower's
share of the bytes), slabs (a variable across a tower's end held as slabs of rows,
one per tower), variables (each column's variables moved to its device before the
optimizer builds its slots; each update computed there), worker_owners (spread
placement in a cluster: each worker owns 1/W of the optimizer state).

May import: towers.data_parallel, towers.model_parallel, and the shared modules.
"""
