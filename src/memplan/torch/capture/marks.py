"""Names capture leaves in the traced program: where the backward starts, and the no-op that
releases a gradient where ``zero_grad(set_to_none=True)`` drops it."""

BACKWARD_MARK = "memplan::backward"
CALL_MARK = "memplan::call:"  # + the index of a call of a stateful object (capture/regions.py)
RELEASE_KIND = "memplan.release"
CALL_KIND = "memplan.call"  # the no-op ops that open and close a call's ops in the graph
