"""autopar's own primitives: the circular pipeline's rotation and the stack's read. Their
rules are in autopar/rules (kinds.ROTATE, kinds.STACK_READ)."""
