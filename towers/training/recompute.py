"""recompute=: activations recomputed in the backward instead of kept from the forward.

TowerTrainer(recompute=...) takes:
- False (the default): every forward's activations live until its backward.
- "stages": GPipe's rematerialisation. Each pipeline stage's forward, on every
  micro-batch, records nothing; only the stage's inputs (the boundary) and the
  state it read are kept, and its backward runs the forward again under a tape
  (model_parallel/flight.py, given TowerOptions.recompute_stages). Without pipeline_cuts the model
  is one stage: only its inputs are kept.
- a list of layer names or paths (op_parallel/paths.py: "/"-separated levels,
  shell wildcards): each layer named runs as one custom-gradient op
  (`recompute_call`) that keeps only its inputs, and its gradient runs the layer's
  call again. A split layer named (op_parallel) runs each part's work so, inside the
  part's own op, on the part's device (op_parallel.layers.parts_recomputed): its
  inputs reach the parts, and its output keeps its parts, as unnamed, and the rerun
  reads its input where the part's forward did (no more bytes between devices). A
  layer holding split layers is one op whose rerun runs their parts again on their
  devices, each part's weights read where they are.

The layers' form is a custom gradient of towers' own, like op_parallel's run_part,
not Keras's `keras.remat` / `keras.RematScope` (on TensorFlow, `tf.recompute_grad`):
- towers runs the model under keras.StatelessScope with the weights as tensors,
  the tower's copies. tf.recompute_grad differentiates the tf.Variables its function
  reads and its explicit inputs, so a weight captured as a tensor gets no gradient:
  it is silently dropped (tests/test_recompute.py shows it). Here each weight's
  value is an explicit input of the op.
- tf.recompute_grad reruns the function when the gradient is taken, outside the
  StatelessScope: the rerun would read the variables themselves, and a Dropout's
  seed state as it is then, not the value the first call read, so it would draw
  another mask. Here the rerun reads the values the first call read, the seed state
  included (the same masks), in the Keras state the first call ran in (an outer
  call's `training`, mixed precision's autocast), and its state updates are dropped
  (the first call's count: nothing advances twice).
- RematScope decides when a layer is created (keras Operation.__init__ reads the
  scope), so it cannot be turned on for a model already built.
Each rerun reads copies of its inputs made after the gradients it starts from have
arrived (a control dependency), so Grappler cannot merge it with the first forward.

A loss added inside a named layer (a sublayer's activity regularizer, add_loss in a
call, a split layer's weight penalty) is an output of its op too, so its gradient
passes the op. Equal to keeping the activations within float round-off: where a
tensor feeds several ops, the tape may sum its gradients in another order. Refused:
a layer whose call reads a variable that it does not hold (another layer's), when the
step is traced, before anything is applied (that variable's gradient would be lost);
jit_compile=True (XLA compiles a tower's forward and backward as one computation,
which merges a rerun with the first forward; XLA rematerialises on its own). With
split layers "stages" reruns each part's custom-gradient op with its stage.
"""

import contextlib

import keras
import tensorflow as tf

from towers import compat
from towers.engine.options import RECOMPUTE_STAGES as STAGES
from towers.op_parallel import layers as op_layers, paths, plan as op_plan


def recomputed_layers(model, recompute, jit_compile):
    """The layers of `model` whose activations `recompute` (TowerOptions.recompute,
    checked) recomputes, in walk order; [] for False and "stages".

    Raises:
      ValueError: one line naming recompute: with jit_compile=True, a name or path that
        matches no layer, or a layer inside another one named.
    """
    if recompute is False:
        return []
    if jit_compile:
        raise ValueError(f"recompute={recompute!r} needs jit_compile=False: XLA compiles a "
                         "tower's forward and backward as one computation and would merge the "
                         "rerun with the first forward (it rematerialises on its own).")
    if recompute == STAGES:
        return []
    if STAGES in recompute:  # would be looked up as a layer path, and not found
        raise ValueError(f"recompute={list(recompute)!r}: {STAGES!r} recomputes every "
                         "stage's whole forward and stands alone; give recompute="
                         f"{STAGES!r} or layer names.")
    try:
        targets = paths.resolve(model, dict.fromkeys(recompute, STAGES))
    except ValueError as error:
        raise ValueError(f"recompute={list(recompute)!r}: {paths.first_line(error)}") from None
    return [paths.locate(model, target.position)[1] for target in targets]


@contextlib.contextmanager
def recomputing(layers):
    """Within it (while a train step is traced), each of `layers` (recomputed_layers')
    has its call recomputed: its instance's `call` replaced, and given back on leaving.
    ("stages" reaches the flights as TowerOptions.recompute_stages.)"""
    with contextlib.ExitStack() as scopes:
        for layer in layers:
            scopes.enter_context(_call_recomputed(layer))
        yield


@contextlib.contextmanager
def _call_recomputed(layer):
    """`layer`'s call as one op (recompute_call); a split layer's as its parts' calls,
    each one op inside the part's own, on its device (op_parallel.layers.run_part): its
    inputs reach each part as they would unnamed, and its output keeps its parts."""
    own = vars(layer).get("call")  # an instance's own call, if it has one
    call = layer.call

    def recomputed(*args, **kwargs):
        if isinstance(layer, op_plan.PARALLEL_FORMS):
            with op_layers.parts_recomputed(recompute_call):
                return call(*args, **kwargs)
        return recompute_call(layer, call, args, kwargs)

    # Straight into the instance's dict: Keras's __setattr__ would track the function.
    vars(layer)["call"] = recomputed
    try:
        yield
    finally:
        if own is None:
            del vars(layer)["call"]
        else:
            vars(layer)["call"] = own


def recompute_call(layer, call, args, kwargs):
    """call(*args, **kwargs), `layer`'s call, as one op whose gradient runs it again.

    The op's inputs are the tensors in args and kwargs and the value of each of
    layer.variables (inside a stateless call the tower's copy, of a split layer's part
    on the part's device; the seed state of a Dropout inside too), so weights get
    their gradients wherever they come from. Its forward keeps no activation. Its
    gradient copies those inputs, each where it is, after the output gradients
    arrive, runs `call` on them under a tape, in the Keras state the first call ran
    in (an outer call's `training`, mixed precision's autocast), and differentiates
    that: the same values, the same dropout masks; a split layer's parts run again on
    their devices (parts_on, which the tower's backward is traced in too). The op's
    own IdentityN, on the current device, takes every input but only its outputs are
    read: Grappler drops the rest, so a part's weights stay on its device. A loss
    added inside the call (a sublayer's activity regularizer, a split layer's weight
    penalty) is an output of the op too, added outside it by the layer that added it.
    The state updates of the first call are kept (assigned, inside a stateless call
    into its scope); the rerun's dropped.
    """
    variables = layer.variables
    # Copies in this graph of what the call reads, which the rerun reads again (inside a
    # tf.cond, a micro-batch that may be empty, the cond's gradient would not feed the
    # rerun a tensor of the graph outside it): the values where they are, the inputs on
    # the op's device, where they go as its inputs and are kept for the rerun.
    values = [_copy_where_it_is(_value(variable)) for variable in variables]
    flat = tf.nest.flatten((args, kwargs))
    is_tensor = [isinstance(item, tf.Tensor) for item in flat]
    # One op input per tensor, however often it is passed: a gradient per input.
    given = list({id(item): item for item, tensor in zip(flat, is_tensor) if tensor}.values())
    position = {id(tensor): i for i, tensor in enumerate(given)}
    tensors = [tf.identity(tensor) for tensor in given]
    trainable = {id(variable) for variable in layer.trainable_variables}
    # Gradients for the floating inputs and the trainable weights; the state gets none.
    differentiable = [t.dtype.is_floating for t in tensors] + [
        id(variable) in trainable and value.dtype.is_floating
        for variable, value in zip(variables, values)]
    keras_state = compat.keras_call_state()  # the rerun's, as the first call's
    first = []  # the first call's (outputs, new state, layers that added its losses)

    def run_call(op_inputs):
        """(outputs, {index into variables: new value}, losses added) of `call` on
        op_inputs (as `tensors` + `values`)."""
        ordered = iter(op_inputs[position[id(item)]] for item, tensor
                       in zip(flat, is_tensor) if tensor)
        call_args, call_kwargs = tf.nest.pack_sequence_as(
            (args, kwargs), [next(ordered) if tensor else item
                             for item, tensor in zip(flat, is_tensor)])
        read = op_inputs[len(tensors):]
        with keras.StatelessScope(list(zip(variables, read)), collect_losses=True,
                                  initialize_variables=False) as scope:
            outputs = call(*call_args, **call_kwargs)
        changed = {i: scope.get_current_value(variable) for i, variable in enumerate(variables)
                   if scope.get_current_value(variable) is not read[i]}
        return outputs, changed, list(scope.losses)

    @tf.custom_gradient
    def op(*op_inputs):
        outputs, changed, losses = run_call(op_inputs)
        first.append((outputs, changed, compat.loss_adders(layer, losses)))

        def gradient(*output_grads, variables=None):
            if variables:  # read inside the call, not the layer's: their gradients would be lost
                raise ValueError(
                    f"recompute: layer {layer.path!r} reads variables of other layers "
                    f"({[v.name for v in variables][:4]}); name a layer that holds them all.")
            arrived = [g for g in output_grads if g is not None]
            with tf.control_dependencies(arrived):  # a forward of its own, after them
                again = [_copy_where_it_is(t) for t in op_inputs]
            sources = [t for t, d in zip(again, differentiable) if d]
            with tf.GradientTape() as tape, keras_state():
                tape.watch(sources)
                outputs, _, losses = run_call(again)  # its state updates dropped
            targets = [(o, g) for o, g in zip(tf.nest.flatten(outputs) + losses, output_grads)
                       if g is not None]
            grads = iter(tape.gradient([o for o, _ in targets], sources,
                                       output_gradients=[g for _, g in targets])
                         if targets else [None] * len(sources))
            return [next(grads) if d else None for d in differentiable]

        return tf.nest.flatten(outputs) + losses, gradient

    flat_outputs = op(*tensors, *values)
    outputs, changed, adders = first[0]
    num_outputs = len(flat_outputs) - len(adders)
    for adder, loss in zip(adders, flat_outputs[num_outputs:]):
        adder.add_loss(loss)  # into the stateless call's scope, where model.losses reads it
    for i, value in changed.items():
        variables[i].assign(value)  # inside a stateless call: into its scope
    return tf.nest.pack_sequence_as(outputs, flat_outputs[:num_outputs])


def _copy_where_it_is(value):
    """tf.identity(value) on value's device: a tensor, a tf.Variable read there."""
    with tf.device(value.device):
        return tf.identity(value)


def _value(variable):
    """What a call reads for `variable` now: a stateless call's value (a table looked up
    where it lives: the variable itself), else its own."""
    value = compat.stateless_value(variable)
    return variable.value if value is None else value
