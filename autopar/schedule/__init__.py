"""Microbatch schedules: the step's loss rewritten to run over microbatches of the batch, in the
one program autopar plans.

- `accumulate`: gradient accumulation, `microbatches=M` (the loop of one stage), and the
  `autopar.value_and_grad` / `autopar.grad` drop-ins that mark the loss to rewrite;
- `gpipe`: pipeline parallelism, `pipeline=S`: the loss's layer stack as S stages (GPipe);
  `ticks`: one tick of its loop;
- `blocks`: a Python loop of blocks in the loss, found and re-traced as one loop to pipeline;
- `separable`: whether a loss is a sum over microbatches, and each operation's share;
- `stored`, `storable`: the circular schedule's stack kept in its placement between steps
  (`keep_placement=True`), and which leaves a step lets be kept so;
- `layout`: the batch in microbatches and shares, gradient trees;
- `microbatches`: how many microbatches ("auto"), and whether the gradient reduces once.
"""
