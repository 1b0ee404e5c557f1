"""What XLA's compilers do to a step's buffers, per platform."""
