"""autopar's own primitives: the circular pipeline's rotation and the stack's read. Each is
defined with its sharding rule: rotate registers its own (rules.table.register); the stack's
read is an identity mark, elementwise by its kind (rules.kinds.MARKS)."""
