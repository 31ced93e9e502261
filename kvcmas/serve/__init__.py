"""The engine side of kvcmas: vLLM's paged-KV layout, a per-session span store, and a vLLM
KV connector. Only modules in this package import vllm, and only those that need it."""
