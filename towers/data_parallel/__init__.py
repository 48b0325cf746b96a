"""Data parallelism: the seven steps of the tower algorithm.

split (1: one shard per tower), replicas (2: the same weights on every tower),
forward, tower and losses (3-4: forward pass, loss and GradientTape on a
tower's own device), aggregate and exchange (5-6: the towers' gradients
gathered and summed, by a route chosen once; across workers too), collectives
(the keyed all-reduce and all-gather ops), options (`TowerOptions`), step
(`run_towers`, steps 1-6 on one screen; `StepSetup`; `tower_gradients`;
step 7's `apply_update`).

May import: towers.model_parallel (a tower may be a pipeline of stages),
towers.devices, towers.errors. Never training, multi_worker or cli.
"""
