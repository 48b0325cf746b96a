"""The engine: the tower step the three techniques plug into.

step (`run_towers`: steps 1-5 over the towers, on one screen; `StepSetup`; step
6's `apply_update`), loop_gradients (`tower_gradients`: steps 1-5 for your own
loop), tower (a tower's steps 3-4: the
step's `StepWork` and the tower's `TowerWork`, frozen; `StageWork`, what each
pipeline stage computes, given to model_parallel's flight), forward (the forward
by `stateless_call`, a shard's share of the loss), losses (`Objective`: the loss as
compile takes it), model_losses (`model.losses` by the layer that added each),
denominators (counted loss terms over the whole batch), options (`TowerOptions`),
custom_step and tower_handle (`tower_step`: steps 1-5 around your own function).

May import: towers.placement, towers.data_parallel, towers.model_parallel,
towers.op_parallel, and the shared modules (docs/architecture.md).
"""
