"""Private TensorFlow names, each beside the public alternative it stands in for
(towers/compat/__init__.py says why they live here)."""

import contextlib

import tensorflow as tf
from tensorflow.core.protobuf import (config_pb2, device_properties_pb2, meta_graph_pb2,
                                     trackable_object_graph_pb2)
from tensorflow.python.data.ops import multi_device_iterator_ops
from tensorflow.python.eager import context as eager_context
from tensorflow.python.eager.polymorphic_function import atomic_function
from tensorflow.python.grappler import cluster as grappler_cluster
from tensorflow.python.grappler import tf_optimizer
from tensorflow.python.training.saving import saveable_object_util

# ---------------------------------------------------------------------------------------
# TensorFlow

# tf.data's iterator that stages each element on its device ahead of use (what
# MirroredStrategy's distributed datasets use inside). Public alternatives:
# tf.data.experimental.prefetch_to_device stages on one device only, and
# tf.distribute's distribute_dataset belongs to a strategy.
OwnedMultiDeviceIterator = multi_device_iterator_ops.OwnedMultiDeviceIterator


def eager_runtime():
    """TensorFlow's eager context: starting a cluster's collective ops from a ServerDef
    with a group leader and device filters, aborting them, checking peers' health, and
    collecting the partitioned graphs a function ran.

    Public alternative: tf.config.experimental_connect_to_cluster, which sets neither
    the collective group leader nor device filters, and has no abort or health check.
    """
    return eager_context.context()


def current_call_config():
    """The serialized ConfigProto a tf.function called eagerly on this thread now is run
    with (its first call optimises its graph by it: the process's, with the user's
    tf.config settings); what call_options_edited edits.

    Private: the eager context's thread-local FunctionCallOptions. Public alternative:
    tf.config.optimizer.set_experimental_options, which sets the whole process's
    grappler options (every function of the user's too) and not the number of its
    passes.
    """
    return eager_context.context().function_call_options.config_proto_serialized


def call_options_edited(config, edit):
    """Call options (for calls_with) of `config` (current_call_config's), its
    RewriterConfig (grappler's settings) changed by edit(rewriter_config) in place."""
    config = config_pb2.ConfigProto.FromString(config)
    edit(config.graph_options.rewrite_options)
    return eager_context.FunctionCallOptions(config_proto=config)


@contextlib.contextmanager
def calls_with(options):
    """Within it, a tf.function called eagerly on this thread runs with `options` (from
    call_options_edited); the thread's own are back on exit."""
    context = eager_context.context()
    previous = context.function_call_options
    context.function_call_options = options
    try:
        yield
    finally:
        context.function_call_options = previous


def runtime_function(function_def, calls):
    """A function the runtime runs, of `function_def` (a tf.function trace's, copied and
    changed), registered while the returned object lives; `calls`: those of the
    functions it calls, kept with it and added with it to a graph that calls it
    (calling_instead).

    Private: AtomicFunction, what a tf.function's trace is to the runtime. Public
    alternative: none; a tf.function registers its own traces, and a trace changed
    after tracing is not one.
    """
    context = eager_context.context()
    context.add_function_def(function_def)
    return atomic_function.AtomicFunction(function_def.signature.name, context, None,
                                          children=list(calls))


def calling_instead(trace, function, args):
    """trace(*args) (a ConcreteFunction) called in the graph being built, its call op then
    made to call `function` (runtime_function's: a copy of trace's FunctionDef under
    another name, so with the same inputs and outputs) instead, which the graph's
    library then holds, with the functions it calls.

    Private: call_instead's. Public alternative: none;
    tf.raw_ops.StatefulPartitionedCall(args, Tout, f=name) takes a
    function already in the graph's library, with the arguments flattened and the
    captures and structured outputs handled by hand, as a ConcreteFunction's call does.
    """
    graph = tf.compat.v1.get_default_graph()
    known = len(graph.get_operations())
    outputs = trace(*args)
    traced_name = trace.function_def.signature.name
    calls = [op for op in graph.get_operations()[known:]
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")
             and op.get_attr("f").name == traced_name]
    if len(calls) != 1:
        raise RuntimeError(f"calling {traced_name} made {len(calls)} call ops, not one")
    call_instead(calls[0], "f", function)
    return outputs


def call_instead(op, attribute, function):
    """Makes `op` (an op of the graph being built) call `function` (runtime_function's,
    with the same inputs and outputs as the function it called) by its function
    attribute `attribute` (a call's f, a cond's branch); the graph's library then holds
    it, with the functions it calls.

    Private: Graph._add_function_recursive and Operation._set_func_attr. Public
    alternative: none, as calling_instead's.
    """
    op.graph._add_function_recursive(function)
    op._set_func_attr(attribute, function.name.decode())


def autograph_context():
    """Whether autograph converts the code calling this: the caller's tf.function with
    autograph on (enabled), off (disabled), or no tf.function (unspecified); for
    converted_as. Read it before entering code that is do_not_convert (which
    disables autograph inside).

    Private: tf.__internal__.autograph.control_status_ctx, as TensorFlow's own
    higher-order functions read it. Public alternative: none; a tf.function's
    `autograph` argument is not visible to the code it calls.
    """
    return tf.__internal__.autograph.control_status_ctx()


def converted_as(function, context):
    """`function` (a user's callable) converted by autograph where `context`
    (autograph_context's) converts its own code, else as it is: a Python `if` on a
    tensor inside it works where it works in the caller's own code, while the code
    that calls it may be do_not_convert.

    Private: tf.__internal__.autograph.tf_convert. Public alternatives:
    tf.autograph.to_graph converts whatever the caller's setting (autograph=False
    too), and tf.autograph.experimental.do_not_convert never converts.
    """
    return tf.__internal__.autograph.tf_convert(function, context, convert_by_default=False)


def graph_function_def(graph, name):
    """The FunctionDef of `name` in the library of `graph` (a graph being built), or
    None where it holds none.

    Private: Graph._get_function. Public alternative: graph.as_graph_def().library,
    which serializes every node of the graph too (a pipeline's step: thousands).
    """
    function = graph._get_function(name)
    return None if function is None else function.definition


def gather_hooks(params, gather):
    """(params, {attribute: replacement}) that, while set on `params` (a keras.Variable),
    make tf.gather(params, indices) along axis 0 return gather(indices, name=name).

    Private: tf.gather calls params.sparse_read(indices, name=name) where params has one
    (its way of telling a resource variable), and Keras's ops.take (an Embedding's
    look-up) passes it the keras.Variable itself; the hook is an attribute of one
    instance. Public alternative: none; a layer's look-up reads a table where the
    caller's device scope says, and a stateless call's value is a copy of the table.
    """
    return params, {"sparse_read": gather}


def optimized_function(function_defs, inputs, devices, config):
    """FunctionDefs of function_defs[0] (which calls the others, and takes `inputs`:
    tf.TensorSpecs, one per argument) optimised by grappler under `config` (a
    ConfigProto) as the runtime optimises a function it does not inline: the
    optimised function first, under a new name, then those it calls. `devices`: the
    device names its nodes name, each a CPU.

    Private: tf_optimizer.OptimizeGraph, on a virtual grappler cluster of `devices` (a
    default cluster starts a session of its own). Public alternative: none; the
    runtime optimises a function's graph when it first runs it, together with the
    graph that calls it and every copy of it that graph inlines.
    """
    graph = tf.Graph()
    with graph.as_default():
        arguments = [tf.compat.v1.placeholder(spec.dtype, spec.shape) for spec in inputs]
        call = tf.raw_ops.StatefulPartitionedCall(
            args=arguments, f=function_defs[0].signature.name,
            Tout=[arg.type for arg in function_defs[0].signature.output_arg])[0].op
    graph_def = graph.as_graph_def()
    graph_def.library.function.extend(function_defs)
    graph_def.library.function[0].attr["_noinline"].b = True  # optimised as a function
    meta_graph = meta_graph_pb2.MetaGraphDef(graph_def=graph_def)
    meta_graph.collection_def["train_op"].node_list.value.append(call.name)  # grappler's fetch
    cluster = grappler_cluster.Cluster(devices=[
        device_properties_pb2.NamedDevice(
            name=device, properties=device_properties_pb2.DeviceProperties(type="CPU"))
        for device in devices])
    try:
        optimized = tf_optimizer.OptimizeGraph(config, meta_graph, verbose=False,
                                               cluster=cluster)
    finally:
        cluster.Shutdown()
    name = next(node.attr["f"].func.name for node in optimized.node if node.name == call.name)
    functions = {function.signature.name: function for function in optimized.library.function}
    del functions[name].attr["_noinline"]
    return [functions.pop(name)] + list(functions.values())


def attach(tensor, name, value):
    """Records `value` on `tensor` (a tf.Tensor) under `name`; attached() reads it back.

    Private: an eager or symbolic tf.Tensor takes new attributes, as Keras's own mask
    (keras_layers.set_keras_mask) relies on. Public alternative: none; a tensor that
    flows on (into a layer, or the loss) carries no metadata of its own.
    """
    setattr(tensor, name, value)
    return tensor


def attached(tensor, name):
    """The value attach() recorded on `tensor` under `name`, or None."""
    return getattr(tensor, name, None)


def saves_own_tensors(trackable):
    """Whether a checkpoint holds tensors `trackable` gives it itself, as a lookup table
    (tf.lookup.experimental.MutableHashTable, a Keras StringLookup's token counts) gives
    its keys and values; a variable does too.

    Public alternative: none; tf.train.Checkpoint asks each object for them when it
    saves (the Trackable._serialize_to_tensors its class defines).
    """
    return saveable_object_util.trackable_has_serialize_to_tensor(trackable)


def saved_variable_names(reader):
    """{checkpoint key: the name of the variable saved under it} of a checkpoint that
    `reader` (tf.train.load_checkpoint) reads; a Keras variable's name is its path
    ("sequential/dense_1/kernel").

    Public alternative: none; the reader gives keys, shapes and dtypes, and the
    names are in the object graph a save writes beside the values, a serialized
    TrackableObjectGraph proto under the key "_CHECKPOINTABLE_OBJECT_GRAPH".
    """
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    return {attribute.checkpoint_key: attribute.full_name for node in graph.nodes
            for attribute in node.attributes if attribute.full_name}
