"""Names capture leaves in the traced program: where the backward starts, and the no-op that
releases a gradient where ``zero_grad(set_to_none=True)`` drops it."""

BACKWARD_MARK = "memplan::backward"
RELEASE_KIND = "memplan.release"
