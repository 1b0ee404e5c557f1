"""The step's loss rewritten at trace time to run over microbatches of the batch, in the one
program autopar plans.

- `accumulate`: gradient accumulation, `microbatches=M` (the loop of one stage), and the
  `autopar.value_and_grad` / `autopar.grad` drop-ins that mark the loss to rewrite;
- `gpipe`: pipeline parallelism, `pipeline=S`: the loss's layer stack as S stages (GPipe);
  `ticks`: one tick of its loop;
- `blocks`: a Python loop of blocks in the loss, found and re-traced as one loop to pipeline;
- `separable`: whether a loss is a sum over microbatches, and each operation's share;
  `microbatch`: one microbatch's share of the equations; `draws`: random draws per example;
- `batches`: the batch in microbatches and shares, gradient trees.

How many microbatches and stages a step takes is planned in autopar/planning (schedules,
microbatches); the state kept in place between steps is autopar/placement's; autopar's own
primitives are autopar/primitives'.
"""
