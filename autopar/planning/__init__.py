"""Planning: pins, the search problem, the searches' drivers (per axis, under a memory budget),
a saved plan's decisions, the Plan's assembly, and the pipeline that runs them for one call."""
