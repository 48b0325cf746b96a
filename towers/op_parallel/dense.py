"""Dense and EinsumDense with their output units ("column") or input units ("row")
split across devices.

A Dense is the EinsumDense "...i,io->...o" with bias on "o", so one description
serves both: a column split is along an output axis that comes from the kernel alone, a
row split along an input axis the kernel contracts (`SplitAxes`). The plan names the
equation's letter ("column:n", "row:u"); plain "column" or "row" splits along the last
such letter.
"""

import collections
import re

import keras
import tensorflow as tf
from keras import ops

from towers.op_parallel import vocab_loss
from towers.op_parallel.layers import build_part, part_sizes, run_part

DENSE_EQUATION = "...i,io->...o"

# Activations computed unit by unit: a column split may apply them to each part apart.
_ELEMENTWISE = {"linear", "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "silu",
                "swish", "sigmoid", "hard_sigmoid", "hard_silu", "hard_swish", "tanh",
                "softplus", "softsign", "exponential", "mish", "celu",
                # keras_hub's GPT-2 feed-forward activation: gelu(x, approximate=True).
                "keras_hub>gelu_approximate"}

SplitAxes = collections.namedtuple(
    "SplitAxes", ["kernel_axis", "tensor_axis", "shape_index", "bias_axis", "letter"])
SplitAxes.__doc__ = """Where a split runs: the kernel's axis; the output's (column) or the
input's (row) axis, negative where counted from the end; the index of the output axis in
EinsumDense's output_shape argument (column); the bias's axis (column; None: no bias);
the equation's letter it runs along."""

# Per split: which letters it may run along, said as the refusals say it.
_ALONG = {"column": "an output-only letter (in the kernel and the output, not the input)",
          "row": "a contracted letter (in the input and the kernel, not the output)"}


def split_kind(how):
    """A plan value's (kind, letter): "row:u" -> ("row", "u"), "column" -> ("column",
    None) (None: the default letter, the last one); any other value -> (how, None)."""
    kind, colon, letter = how.partition(":") if isinstance(how, str) else (how, "", None)
    return (kind, letter) if colon and kind in _ALONG else (how, None)


def equation_of(layer):
    """(equation, bias_axes) of a Dense ("...i,io->...o", bias on "o") or EinsumDense."""
    if isinstance(layer, keras.layers.Dense):
        return DENSE_EQUATION, "o" if layer.use_bias else None
    return layer.equation, layer.bias_axes


def _parse(equation):
    """(whether the batch-like axes are elided on the left, input letters, kernel
    letters, output letters) of an EinsumDense equation."""
    match = re.fullmatch(r"(\.\.\.)?([a-zA-Z]+)(\.\.\.)?,([a-zA-Z]+)->(\.\.\.)?([a-zA-Z]+)"
                         r"(\.\.\.)?", equation.replace(" ", ""))
    if match is None:
        raise ValueError(f"cannot split the EinsumDense equation {equation!r}.")
    left, inputs, _, kernel, _, outputs, _ = match.groups()
    return bool(left), inputs, kernel, outputs


def _letters(inputs, kernel, outputs, how):
    """The letters a `how` split may run along, in the output's (column) or input's (row) order."""
    if how == "column":
        return [c for c in outputs if c in kernel and c not in inputs]
    return [c for c in inputs if c in kernel and c not in outputs]


def split_axes(equation, bias_axes, how, letter=None):
    """The SplitAxes of a "column" or "row" split of an EinsumDense `equation` along
    `letter`: an output-only letter (column) or a contracted one (row); None: the last.

    Raises:
      ValueError: the equation has no letter to split that way, `letter` is not one of
        them, or (column) a bias that does not run along the split axis.
    """
    left, inputs, kernel, outputs = _parse(equation)
    letters = _letters(inputs, kernel, outputs, how)
    if not letters:
        raise ValueError(f"a {how!r} split needs {_ALONG[how]}, and {equation!r} has none.")
    if letter is None:
        letter = letters[-1]
    elif letter not in letters:
        raise ValueError(f"a {how!r} split of {equation!r} is along {_ALONG[how]}: "
                         f"{' or '.join(map(repr, letters))}, not {letter!r}.")
    spec = outputs if how == "column" else inputs
    # Keras elides on the left of both sides or on the right of both: with "..." in
    # front an axis is counted from the end.
    tensor_axis = spec.index(letter) - (len(spec) if left else 0)
    if how == "row":
        return SplitAxes(kernel.index(letter), tensor_axis, None, None, letter)
    # EinsumDense's output_shape leaves out the batch axis, the first of the output's
    # letters unless "..." stands in front of them.
    shape_index = outputs.index(letter) - (0 if left else 1)
    bias_axis = None
    if bias_axes:
        if letter not in bias_axes:
            raise ValueError(f"a 'column' split of {equation!r} is along axis {letter!r}, which "
                             f"its bias (bias_axes={bias_axes!r}) does not run along.")
        # The bias has the output's axes from its first bias letter on (EinsumDense).
        bias_spec = outputs[min(outputs.index(c) for c in bias_axes):]
        bias_axis = bias_spec.index(letter)
    return SplitAxes(kernel.index(letter), tensor_axis, shape_index, bias_axis, letter)


def kind_of_kernel_axis(equation, axis):
    """The plan kind that splits an EinsumDense `equation`'s kernel along `axis`:
    "column" or "row" where its letter is the default one (the last), else
    "column:<letter>" or "row:<letter>".

    Raises:
      ValueError: the axis's letter is neither output-only nor contracted.
    """
    _, inputs, kernel, outputs = _parse(equation)
    letter = kernel[axis]
    for how in _ALONG:
        letters = _letters(inputs, kernel, outputs, how)
        if letter in letters:
            return how if letter == letters[-1] else f"{how}:{letter}"
    raise ValueError(f"kernel dim {axis} is {letter!r} in {equation!r}, but a column split "
                     f"is along {_ALONG['column']} and a row split {_ALONG['row']}")


def is_elementwise(activation):
    """Whether `activation` (a Keras activation) is computed unit by unit."""
    try:
        name = keras.activations.serialize(activation)
    except (ValueError, TypeError):
        return False
    if isinstance(name, dict):  # a registered function: {"config": "package>name", ...}
        name = name.get("config")
    return isinstance(name, str) and name in _ELEMENTWISE


class _Parted(keras.layers.Layer):
    """A Dense or EinsumDense as parts, part j built and run on devices[j].

    layer_config: the layer's get_config(); layer_class: "Dense" or "EinsumDense";
    letter: the equation's letter it splits along (None: the last one `how` may
    split along).
    """

    def __init__(self, layer_config, layer_class, devices, how, letter=None,
                 activity_regularizer=None, **kwargs):
        super().__init__(name=layer_config["name"], dtype=layer_config.get("dtype"),
                         trainable=layer_config.get("trainable", True),
                         activity_regularizer=activity_regularizer, **kwargs)
        self.layer_config, self.layer_class = dict(layer_config), layer_class
        self.devices = list(devices)
        self.supports_masking = True  # a mask passes on, as through Dense
        self.activation = keras.activations.get(layer_config["activation"])
        self.dense = layer_class == "Dense"
        self.axes = split_axes(DENSE_EQUATION if self.dense else layer_config["equation"],
                               "o" if self.dense else layer_config["bias_axes"], how, letter)

    @property
    def use_bias(self):
        return self.layer_config["use_bias"] if self.dense else bool(
            self.layer_config["bias_axes"])

    def _part(self, j, output_size, use_bias):
        """Part j: the layer with `output_size` units on its split output axis (None: as
        the layer's), its own bias or none, no activation nor activity regularizer (both
        applied where parts meet, on the whole output)."""
        config = {**self.layer_config, "name": f"part_{j}", "activation": None,
                  "activity_regularizer": None, "dtype": self.dtype_policy}
        if self.dense:
            config.update(use_bias=use_bias, units=output_size or config["units"])
        else:
            config.update(bias_axes=config["bias_axes"] if use_bias else None)
            if output_size is not None:
                shape = config["output_shape"]
                shape = [shape] if isinstance(shape, int) else list(shape)
                shape[self.axes.shape_index] = output_size
                config["output_shape"] = shape
        return getattr(keras.layers, self.layer_class).from_config(config)

    def build(self, input_shape):
        for device, part, shape in zip(self.devices, self.parts,
                                       self._part_input_shapes(input_shape)):
            build_part(part, device, shape)

    def get_config(self):
        return {**super().get_config(), "layer_config": self.layer_config,
                "layer_class": self.layer_class, "devices": self.devices,
                "letter": self.axes.letter}


class ColumnDense(_Parted):
    """Dense or EinsumDense with its output units split: part j computes units
    [start_j, end_j) of the split axis on devices[j] from the whole input; the parts'
    outputs are concatenated. A row layer right after takes the parts as they are
    (Megatron's pairing): nothing is gathered between the two."""

    def __init__(self, layer_config, layer_class, devices, units, **kwargs):
        super().__init__(layer_config, layer_class, devices, "column", **kwargs)
        self.units = units
        self.sizes = part_sizes(units, len(self.devices))
        self.parts = [self._part(j, size, self.use_bias) for j, size in enumerate(self.sizes)]

    def _part_input_shapes(self, input_shape):
        return [input_shape] * len(self.parts)

    def compute_output_shape(self, input_shape):
        shape = list(self.parts[0].compute_output_shape(input_shape))
        shape[self.axes.tensor_axis] = self.units
        return tuple(shape)

    def call(self, inputs):
        elementwise, outputs = is_elementwise(self.activation), []
        for j, part in enumerate(self.parts):
            call = (lambda x, part=part: self.activation(part(x))) if elementwise else part
            outputs.append(run_part(self.devices, j, part, call, inputs))  # size_j units
        joined = ops.concatenate(outputs, axis=self.axes.tensor_axis)
        if not elementwise:
            return self.activation(joined)  # one that mixes units (softmax) sees them all
        # For a row layer next (RowDense.call) or the loss (vocab_loss): the parts as they are.
        return vocab_loss.mark_parts(joined, outputs)

    def layout(self):
        """Per weight of the layer (kernel, bias): (axis, the parts' variables joined
        along it)."""
        weights = [(self.axes.kernel_axis, [part.kernel for part in self.parts])]
        if self.use_bias:
            weights.append((self.axes.bias_axis, [part.bias for part in self.parts]))
        return weights


class RowDense(_Parted):
    """Dense or EinsumDense with its input units split: part j multiplies input units
    [start_j, end_j) of the split axis by its slice of the kernel on devices[j]; the
    partial products are summed, then the bias (part 0's) and the activation."""

    def __init__(self, layer_config, layer_class, devices, input_units, **kwargs):
        super().__init__(layer_config, layer_class, devices, "row", **kwargs)
        self.input_units = input_units
        self.sizes = part_sizes(input_units, len(self.devices))
        # Part 0 holds the bias: added once, after the sum.
        self.parts = [self._part(j, None, self.use_bias and j == 0)
                      for j in range(len(self.sizes))]

    def _part_input_shapes(self, input_shape):
        shapes = []
        for size in self.sizes:
            shape = list(input_shape)
            shape[self.axes.tensor_axis] = size
            shapes.append(tuple(shape))
        return shapes

    def compute_output_shape(self, input_shape):
        return self.parts[0].compute_output_shape(self._part_input_shapes(input_shape)[0])

    def call(self, inputs):
        pieces = vocab_loss.parts_of(inputs)
        if pieces is None or [p.shape[self.axes.tensor_axis] for p in pieces] != self.sizes:
            # Sliced before the parts: each receives, and sends back the gradient of, its slice.
            pieces = tf.split(inputs, self.sizes, axis=self.axes.tensor_axis)
        partials = [run_part(self.devices, j, part, part, piece)
                    for j, (part, piece) in enumerate(zip(self.parts, pieces))]
        return self.activation(ops.sum(ops.stack(partials), axis=0))

    def get_config(self):
        return {**super().get_config(), "input_units": self.input_units}

    def layout(self):
        """Per weight of the layer: (axis, the parts' kernels joined along it), and the
        bias (axis None: one variable, part 0's, holds it whole)."""
        weights = [(self.axes.kernel_axis, [part.kernel for part in self.parts])]
        if self.use_bias:
            weights.append((None, [self.parts[0].bias]))
        return weights
