"""Which rows a step is traced for: its batch's, where the batches keep them, else any.

A step traced for its batch's rows (and its towers' work for their shards' rows) knows
every shape as it is traced: TensorFlow's gradients take the shapes as constants, and
grappler folds the rest of the shape arithmetic away. A 4-tower split transformer's
tower is 691 nodes where it was 978 traced for any rows, and the step's first call
0.6-0.7 s where it was 0.9-1.0 s (benchmarks/RESULTS.md, "Steps traced for their
rows"). Such a step serves batches of those rows only; one traced for any rows serves
them all, at one trace.

So, as Keras's own train function (tf.function's reduce_retracing): the first batch
of a structure is traced for its rows, and a batch of other rows takes one step traced
for any rows, which every later one of other rows calls too. Where the batches' source
says their rows vary (a tf.data.Dataset whose element_spec leaves dim 0 unknown, a
generator: fit, evaluate and predict tell it, `from_source`), every batch takes the
step for any rows from the first: one trace for them all, as Keras's fit on such data.
"""

from towers.data_parallel import split
from towers.training import compiled


class RowCounts:
    """Per kind of step ("train", "eval", "predict") and batch structure, whether a
    batch is traced for its rows (`traced_for_rows`)."""

    def __init__(self):
        self._first = {}  # (kind, structure) -> the rows its first batch had
        self._vary = set()  # the kinds whose batches come from a source whose rows vary

    def from_source(self, kind, source):
        """Tells where `kind`'s batches come from now: `source` is a tf.data.Dataset or
        iterator, or a prefetch.ShardIterator (its element_spec says whether their rows
        stay the same), or any other iterable (rows that may vary)."""
        spec = getattr(source, "element_spec", None)
        if spec is None or split.rows_vary(spec):
            self._vary.add(kind)
        else:
            self._vary.discard(kind)

    def traced_for_rows(self, kind, batch, rows):
        """Whether `kind`'s step for `batch` (Tensors, or split.Shards of them; rows: its
        rows, or its shards', ints) is traced for those rows. The first batch of a
        structure asked about sets its rows."""
        if kind in self._vary:
            return False
        first = self._first.setdefault((kind, compiled.batch_structure(batch)), tuple(rows))
        return first == tuple(rows)
