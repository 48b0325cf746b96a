"""recompute=: activations recomputed in the backward instead of kept from the forward.

TowerTrainer(recompute=...) takes:
- False (the default): every forward's activations live until its backward.
- "stages": GPipe's rematerialisation. Each pipeline stage's forward, on every
  micro-batch, records nothing; only the stage's inputs (the boundary) and the
  state it read are kept, and its backward runs the forward again under a tape
  (data_parallel/flight.py, given TowerOptions.recompute_stages). Without pipeline_cuts the model
  is one stage: only its inputs are kept.
- a list of layer names or paths (op_parallel/paths.py: "/"-separated levels,
  shell wildcards): each layer named runs as one custom-gradient op
  (`recompute_call`) that keeps only its inputs, and its gradient runs the layer's
  call again.

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
  included (the same masks), and its state updates are dropped (the first call's
  count: nothing advances twice).
- RematScope decides when a layer is created (keras Operation.__init__ reads the
  scope), so it cannot be turned on for a model already built.
Each rerun reads copies of its inputs made after the gradients it starts from have
arrived (a control dependency), so Grappler cannot merge it with the first forward.

A layer inside which a loss is added is refused, its gradient would not pass the op: a
sublayer's activity regularizer when the trainer is built, add_loss in a call when the
step is traced, before anything is applied. (The named layer's own activity regularizer
applies to the op's outputs.) So is a layer whose call reads a variable that it does not
hold (another layer's), when the step is traced: that variable's gradient would be lost. jit_compile=True is
refused (XLA compiles a tower's forward and backward as one computation, which
merges a rerun with the first forward; XLA rematerialises on its own). With split
layers "stages" reruns each part's custom-gradient op with its stage; naming layers of
a split model is refused (not built yet).
"""

import contextlib

import keras
import tensorflow as tf

from towers import compat
from towers.data_parallel.options import RECOMPUTE_STAGES as STAGES
from towers.op_parallel import grid as op_grid, paths


def recomputed_layers(model, recompute, jit_compile):
    """The layers of `model` whose activations `recompute` (TowerOptions.recompute,
    checked) recomputes, in walk order; [] for False and "stages".

    Raises:
      ValueError: one line naming recompute: with jit_compile=True, with split layers,
        a name or path that matches no layer, a layer inside another one named, or one
        holding a sublayer with an activity regularizer.
    """
    if recompute is False:
        return []
    if jit_compile:
        raise ValueError(f"recompute={recompute!r} needs jit_compile=False: XLA compiles a "
                         "tower's forward and backward as one computation and would merge the "
                         "rerun with the first forward (it rematerialises on its own).")
    if recompute == STAGES:
        return []
    if op_grid.is_split(model):
        raise ValueError(f"recompute={list(recompute)!r} cannot name layers of a model with "
                         "split layers yet (their parts are custom-gradient ops of their "
                         "own); pass recompute='stages' or False.")
    try:
        targets = paths.resolve(model, dict.fromkeys(recompute, STAGES))
    except ValueError as error:
        raise ValueError(f"recompute={list(recompute)!r}: {paths.first_line(error)}") from None
    layers = [paths.locate(model, target.position)[1] for target in targets]
    for target, layer in zip(targets, layers):
        regularized = [path for path, sublayer, _ in paths.walk(layer)
                       if getattr(sublayer, "activity_regularizer", None) is not None]
        if regularized:
            raise ValueError(f"recompute: a loss is added inside layer {target.path!r} (the "
                             f"activity regularizer of {regularized[0]!r}), whose gradient its "
                             "recomputation would drop; leave it out of recompute, or name "
                             "the layers around it.")
    return layers


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
    own = vars(layer).get("call")  # an instance's own call, if it has one
    call = layer.call
    # Straight into the instance's dict: Keras's __setattr__ would track the function.
    vars(layer)["call"] = lambda *args, **kwargs: recompute_call(layer, call, args, kwargs)
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
    layer.variables (inside a stateless call, the tower's copy; the seed state of a
    Dropout inside too), so weights get their gradients wherever they come from. Its
    forward keeps no activation. Its gradient copies those inputs after the output
    gradients arrive, runs `call` on them under a tape and differentiates that: the
    same values, the same dropout masks. The state updates of the first call are
    kept (assigned, inside a stateless call into its scope); the rerun's dropped.
    """
    variables = layer.variables
    values = [_value(variable) for variable in variables]
    flat = tf.nest.flatten((args, kwargs))
    is_tensor = [isinstance(item, tf.Tensor) for item in flat]
    tensors = [item for item, tensor in zip(flat, is_tensor) if tensor]
    unique = {}  # one op input per tensor, however often it is passed
    for tensor in tensors + values:
        unique.setdefault(id(tensor), tensor)
    position = {key: i for i, key in enumerate(unique)}
    trainable = {id(variable) for variable in layer.trainable_variables}
    # Gradients for the floating inputs and the trainable weights; the state gets none.
    wanted = {id(t) for t in tensors} | {id(value) for variable, value in zip(variables, values)
                                         if id(variable) in trainable}
    differentiable = [t.dtype.is_floating and key in wanted for key, t in unique.items()]
    first = []  # the first call's (outputs, new state)

    def run_call(op_inputs):
        """(outputs, {index into variables: new value}, losses) of `call` on op_inputs."""
        given = iter(op_inputs[position[id(t)]] for t in tensors)
        call_args, call_kwargs = tf.nest.pack_sequence_as(
            (args, kwargs), [next(given) if tensor else item
                             for item, tensor in zip(flat, is_tensor)])
        read = [op_inputs[position[id(value)]] for value in values]
        with keras.StatelessScope(list(zip(variables, read)), collect_losses=True,
                                  initialize_variables=False) as scope:
            outputs = call(*call_args, **call_kwargs)
        changed = {i: scope.get_current_value(variable) for i, variable in enumerate(variables)
                   if scope.get_current_value(variable) is not read[i]}
        return outputs, changed, scope.losses

    @tf.custom_gradient
    def op(*op_inputs):
        outputs, changed, losses = run_call(op_inputs)
        if losses:
            raise ValueError(f"recompute: a loss is added inside layer {layer.path!r} (a "
                             "sublayer's activity regularizer, or add_loss in its call), whose "
                             "gradient its recomputation would drop; leave it out of recompute.")
        first.append((outputs, changed))
        flat_outputs = tf.nest.flatten(outputs)

        def gradient(*output_grads, variables=None):
            if variables:  # read inside the call, not the layer's: their gradients would be lost
                raise ValueError(
                    f"recompute: layer {layer.path!r} reads variables of other layers "
                    f"({[v.name for v in variables][:4]}); name a layer that holds them all.")
            arrived = [g for g in output_grads if g is not None]
            with tf.control_dependencies(arrived):  # a forward of its own, after them
                again = [tf.identity(t) for t in op_inputs]
            sources = [t for t, d in zip(again, differentiable) if d]
            with tf.GradientTape() as tape:
                tape.watch(sources)
                rerun = tf.nest.flatten(run_call(again)[0])  # its state updates dropped
            given = [(o, g) for o, g in zip(rerun, output_grads) if g is not None]
            grads = iter(tape.gradient([o for o, _ in given], sources,
                                       output_gradients=[g for _, g in given])
                         if given else [None] * len(sources))
            return [next(grads) if d else None for d in differentiable]

        return flat_outputs, gradient

    flat_outputs = op(*unique.values())
    outputs, changed = first[0]
    for i, value in changed.items():
        variables[i].assign(value)  # inside a stateless call: into its scope
    return tf.nest.pack_sequence_as(outputs, flat_outputs)


def _value(variable):
    """What a call reads for `variable` now: a stateless call's value, else its own."""
    value = compat.stateless_value(variable)
    return variable.value if value is None else value
