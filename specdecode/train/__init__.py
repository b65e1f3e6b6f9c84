"""Training drafters for a target on this machine: data built from the target's own
answers and from local text and code (``specdecode train data``)."""
