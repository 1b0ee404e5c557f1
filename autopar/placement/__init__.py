"""State kept in place between steps: the circular schedule's stack stored in its placement
(`stored`, which leaves may be: `storable`), and a Python loop's layers kept stacked (`lanes`,
found by `vectorise`)."""
