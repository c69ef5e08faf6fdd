"""The contracts every layer shares, with no torch import: errors, the engine
configuration and its command-line arguments, sampling and structured-output
parameters, the speculative configuration, outputs, and the wire protocol
between the engine process and its frontend."""
