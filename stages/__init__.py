"""One page per pipeline stage: read the inputs, call the library (``packline``), write the
outputs and the completion record."""
