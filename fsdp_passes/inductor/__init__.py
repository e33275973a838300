"""The only package importing ``torch._inductor``: installing the passes, the pass objects, the scheduler-node
adapter, graph capture for tests."""
