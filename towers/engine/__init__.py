"""The engine: the tower step the three techniques plug into.

step (`run_towers`: steps 1-5 over the towers, on one screen; `StepSetup`; step 6's
`apply_update`), loop_gradients (`tower_gradients`: steps 1-5 for your own loop),
tower (a tower's steps 3-4: the step's `StepWork` and the tower's `TowerWork`,
frozen; `StageWork`, what each pipeline stage computes, given to model_parallel's
flight), traced_tower (a tower's work traced once for every tower: `compiled_tower`)
and tower_trace (a trace copied for each tower with its own devices), forward (the
forward by `stateless_call`, a shard's share of the loss), losses (`Objective`: the
loss as compile takes it), model_losses (`model.losses` by the layer that added
each), denominators (counted loss terms over the whole batch), options
(`TowerOptions`), custom_step, tower_handle and tower_calls (`tower_step`: steps 1-5
around your own function, a model's call traced once for every tower).

May import: towers.placement, towers.data_parallel, towers.model_parallel,
towers.op_parallel, and the shared modules (docs/architecture.md).
"""
