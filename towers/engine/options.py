"""TowerOptions: how the tower step treats gradients and state, checked once."""

import dataclasses
from typing import Optional, Union

from towers import errors
from towers.data_parallel import batch_statistics, exchange, replicas as replicas_lib
from towers.model_parallel import schedule

ON_NONFINITE = ("raise", "skip")
STATE_POLICIES = ("mean", "first_tower")
SPARSE_POLICIES = ("keep", "dense")
EMBEDDING_LOOKUPS = ("table", "copy")
RECOMPUTE_STAGES = "stages"


@dataclasses.dataclass(frozen=True)
class TowerOptions:
    """How the tower step treats gradients and state; checked on construction.

    Attributes:
      accum_steps: another name for micro_batches, with the "1f1b" schedule
        (one micro-batch's activations alive at a time): gradient accumulation.
        Set one of the two; micro_batches holds the value either way.
      clip_global_norm: None, or clip the averaged gradient to this global norm.
      sparse_policy: "keep" (tf.IndexedSlices stay sparse), "dense" (densified
        on each tower), or a float in (0, 1]: densify a variable's gradient when
        a tower's first shard looks up more than that fraction of its rows.
      state_policy: "mean" (new non-trainable values averaged by shard size) or
        "first_tower" (tower 0's values, as the classic tutorials do).
      on_nonfinite: "raise" (NonFiniteError, nothing applied) or "skip"
        (nothing applied, counted in logs["skipped_steps"]).
      aggregation: how gradients meet, one of exchange.AGGREGATIONS: "main"
        (gathered on the main device), "tree", "collective" or "nccl".
      pack_gradients: exchange each tower's dense gradients as one flat buffer.
      variable_placement: "main" (towers read the main device's variables),
        "replicated" (each tower reads its own copy, written from the main
        values at the start of each step) or "spread" (each variable, its
        gradients' sum and its optimizer slots live on one of the towers, each
        tower filled to 1/N of the bytes, a variable across a tower's end held
        as slabs of rows: columns.spread_owners, slabs.py).
      micro_batches: micro-batches each tower's shard is split into, run one
        after another through its stages (one stage: gradient accumulation);
        their gradients are added up before the towers'.
      pipeline_schedule: the order of each stage's forwards and backwards, one
        of schedule.SCHEDULES: "gpipe" or "1f1b".
      embedding_lookup: "table" (each tower sends its ids to an Embedding table's
        device and receives only the rows it looked up; op_parallel.tables) or
        "copy" (step 2 copies the whole table to every tower, as any weight).
        "table" applies with variable_placement="main" or "spread" and without
        jit_compile.
      recompute: False (every forward's activations kept until its backward),
        "stages" (each stage's forward rerun in its backward, per micro-batch:
        only the stages' inputs kept), or layer names or paths, held as a tuple
        (those layers' activations rerun in the backward); training/recompute.py.
      batch_statistics: "per_tower" (each BatchNormalization normalises a tower's
        shard by the shard's statistics; those built synchronized=True excepted) or
        "global" (every one by the global batch's, met across the towers inside
        the forward and backward: one device's numbers); batch_statistics.py.
    """
    accum_steps: int = 1
    clip_global_norm: Optional[float] = None
    sparse_policy: Union[str, float] = "keep"
    state_policy: str = "mean"
    on_nonfinite: str = "raise"
    aggregation: str = "main"
    pack_gradients: bool = False
    variable_placement: str = "main"
    micro_batches: int = 1
    pipeline_schedule: str = "gpipe"
    embedding_lookup: str = "table"
    recompute: Union[bool, str, tuple] = False
    batch_statistics: str = batch_statistics.PER_TOWER

    def __post_init__(self):
        # Frozen: the checked counts are set as Python ints (np.int64(2) is taken too).
        for name in ("accum_steps", "micro_batches"):
            object.__setattr__(self, name, errors.positive_integer(name, getattr(self, name)))
        if self.clip_global_norm is not None and not (
                isinstance(self.clip_global_norm, (int, float))
                and not isinstance(self.clip_global_norm, bool) and self.clip_global_norm > 0):
            raise ValueError(
                f"clip_global_norm must be a positive number or None, got {self.clip_global_norm!r}.")
        if self.sparse_policy not in SPARSE_POLICIES and not (
                isinstance(self.sparse_policy, float) and 0 < self.sparse_policy <= 1):
            raise ValueError(
                f"sparse_policy must be one of {SPARSE_POLICIES} or a density threshold in "
                f"(0, 1], got {self.sparse_policy!r}.")
        if self.state_policy not in STATE_POLICIES:
            raise ValueError(
                f"state_policy must be one of {STATE_POLICIES}, got {self.state_policy!r}.")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}.")
        if self.aggregation not in exchange.AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {exchange.AGGREGATIONS}, got "
                             f"{self.aggregation!r}.")
        if not isinstance(self.pack_gradients, bool):
            raise ValueError(f"pack_gradients must be True or False, got {self.pack_gradients!r}.")
        if self.micro_batches > 1 and self.accum_steps > 1:
            raise ValueError(
                f"accum_steps={self.accum_steps} and micro_batches={self.micro_batches} both "
                "split each tower's shard into micro-batches run one after another; set one "
                "of them (micro_batches with pipeline stages).")
        if self.pipeline_schedule not in schedule.SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {schedule.SCHEDULES}, got "
                             f"{self.pipeline_schedule!r}.")
        if self.variable_placement not in replicas_lib.VARIABLE_PLACEMENTS:
            raise ValueError(f"variable_placement must be one of "
                             f"{replicas_lib.VARIABLE_PLACEMENTS}, got {self.variable_placement!r}.")
        if self.embedding_lookup not in EMBEDDING_LOOKUPS:
            raise ValueError(f"embedding_lookup must be one of {EMBEDDING_LOOKUPS}, got "
                             f"{self.embedding_lookup!r}.")
        if self.batch_statistics not in batch_statistics.BATCH_STATISTICS:
            raise ValueError(f"batch_statistics must be one of "
                             f"{batch_statistics.BATCH_STATISTICS}, got {self.batch_statistics!r}.")
        if self.recompute is not False and self.recompute != RECOMPUTE_STAGES:
            names = self.recompute
            if not (isinstance(names, (list, tuple)) and names
                    and all(isinstance(name, str) and name for name in names)):
                raise ValueError(f"recompute must be False, 'stages' or a non-empty list of "
                                 f"layer names or paths, got {names!r}.")
            object.__setattr__(self, "recompute", tuple(names))
        if self.accum_steps > 1:  # the alias: accumulation is a one-stage pipeline
            object.__setattr__(self, "micro_batches", self.accum_steps)
            object.__setattr__(self, "pipeline_schedule", "1f1b")

    @classmethod
    def field_names(cls):
        """The options' names, in the order of the class's fields."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def given(cls, options, keywords):
        """TowerTrainer's options: `options` itself where one was given, else a
        TowerOptions of `keywords` ({field: value}, the trainer's keyword options). With
        `options`, no keyword may differ from its default: each is set in one place.

        Raises:
          ValueError: `options` that is not a TowerOptions, or a field set both ways;
            what TowerOptions refuses.
        """
        if options is None:
            return cls(**keywords)
        if not isinstance(options, cls):
            raise ValueError(
                f"options must be a towers.TowerOptions, got {type(options).__name__}.")
        defaults = cls()
        twice = sorted(name for name, value in keywords.items()
                       if value != getattr(defaults, name))
        if twice:
            raise ValueError(f"{', '.join(twice)} given both as keyword options and in "
                             "options=; set each in one place (the TowerOptions, or the "
                             "keywords alone).")
        return options

    @property
    def recompute_stages(self):
        """Whether each pipeline stage's forward is rerun in its backward (Flight)."""
        return self.recompute == RECOMPUTE_STAGES
