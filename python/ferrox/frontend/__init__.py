"""The client side of the engine process: AsyncLLM, the engine client (ZMQ),
the output processor and detokenizer, and data-parallel replicas."""
